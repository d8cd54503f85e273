"""GRPO judged by evaluation: held-out prompts training never draws, scored by greedy decoding.

The reversal task's prompt space is every digit string of ``1..max_digits`` digits (1,111,110
at 6), but its short lengths are small: the 10 one-digit and 100 two-digit prompts are all seen
many times in training, so nothing of those lengths can be held out. :class:`PromptSplit` holds
out ``n`` distinct prompts, drawn by a seed of their own (the same set for every run seed), in
equal shares over the lengths whose space is at least 10 times their share (at ``n`` = 256 and
``max_digits`` = 6: 64 each of lengths 3, 4, 5 and 6, at most 6.4% of the 3-digit prompts), and
draws training prompts as :func:`~conduit_dist.rl.grpo.make_prompts` does, redrawing any that
is held out. :func:`evaluate` decodes each held-out prompt greedily and scores it with the
task's reward: ``exact`` is the share answered exactly (reward 1), ``reward`` the mean partial
credit.

Example::

    split = PromptSplit(256, max_digits=6, seed=1234)
    prompts = split.train(8, np.random.default_rng(0))  # never one of split.heldout
    evaluate(policy, split.heldout, max_new=8)  # {"exact": ..., "reward": ...}
"""

from __future__ import annotations

import math

import numpy as np
import torch

from conduit_dist.rl.grpo import EOS, PAD, SEP, make_prompts, reward
from conduit_dist.rl.lm import TinyLM, generate


class PromptSplit:
    """A fixed held-out prompt set, and training prompts drawn disjoint from it.

    Args:
        n: held-out prompts (distinct).
        max_digits: the longest prompt digit string (the task's).
        seed: the held-out set's own random seed.

    Raises:
        ValueError: ``n < 1``, or no prompt length has room for its share 10 times over.
    """

    def __init__(self, n: int, max_digits: int, seed: int) -> None:
        if n < 1:
            raise ValueError(f"PromptSplit: expected n >= 1 held-out prompts, got {n}")
        self.max_digits = max_digits
        lengths = list(range(1, max_digits + 1))
        while lengths and 10 ** lengths[0] < 10 * math.ceil(n / len(lengths)):
            lengths.pop(0)  # too few strings of this length to hold a share out
        if not lengths:
            raise ValueError(
                f"PromptSplit: {n} held-out prompts do not fit digit strings of 1..{max_digits} "
                f"(each length needs 10x its share); expected fewer prompts or more digits"
            )
        rng = np.random.default_rng(seed)
        shares = np.diff(np.linspace(0, n, len(lengths) + 1).round().astype(int))
        self.lengths = lengths
        self.heldout: list[list[int]] = []
        for k, share in zip(lengths, shares):
            for v in rng.choice(10**k, size=int(share), replace=False).tolist():
                self.heldout.append([*map(int, str(v).zfill(k)), SEP])
        self._keys = {tuple(p) for p in self.heldout}

    def __contains__(self, prompt: list[int]) -> bool:
        return tuple(prompt) in self._keys

    def train(self, n: int, rng: np.random.Generator) -> list[list[int]]:
        """``n`` training prompts: :func:`make_prompts`'s draw, a held-out one redrawn.

        Args:
            n: prompts to make.
            rng: the run's random source.

        Returns:
            ``n`` token-id lists, none of them held out.
        """
        prompts = make_prompts(n, rng, self.max_digits)
        for i, p in enumerate(prompts):
            while p in self:
                p = make_prompts(1, rng, self.max_digits)[0]
            prompts[i] = p
        return prompts


@torch.no_grad()
def greedy_rewards(policy: TinyLM, prompts: list[list[int]], max_new: int) -> torch.Tensor:
    """Each prompt's reward for the policy's greedy answer (one batched decode).

    Args:
        policy: the policy (its mode is restored after).
        prompts: reversal prompts.
        max_new: the most tokens an answer may have.

    Returns:
        ``[len(prompts)]`` float64 rewards (``1.0``: exact).
    """
    if not prompts:
        return torch.zeros(0, dtype=torch.float64)
    was_training = policy.training
    policy.eval()
    tokens, _, lengths = (t.cpu() for t in generate(policy, prompts, max_new, EOS, PAD, None, True))
    policy.train(was_training)
    return torch.tensor(
        [reward(p, tokens[i, : lengths[i]].tolist()) for i, p in enumerate(prompts)],
        dtype=torch.float64,
    )


def evaluate(policy: TinyLM, prompts: list[list[int]], max_new: int) -> dict[str, float]:
    """Greedy exact match and mean reward over prompts.

    Args:
        policy: the policy.
        prompts: reversal prompts (non-empty).
        max_new: the most tokens an answer may have.

    Returns:
        ``exact`` (share of prompts answered exactly) and ``reward`` (mean partial credit).
    """
    r = greedy_rewards(policy, prompts, max_new)
    return {"exact": float((r == 1).double().mean()), "reward": float(r.mean())}
