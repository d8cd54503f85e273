"""GRPO's algorithmic core on a synthetic verifiable task, with no distributed code.

The task: reverse a digit string. A prompt is ``d_1 .. d_n SEP`` (``1 <= n <= max_digits``),
the answer ``d_n .. d_1 EOS``. :func:`reward` gives partial credit in ``[0, 1]``: the number of
positions that hold the right digit over ``max(n, response digits)``; a response without
``EOS`` (cut at ``max_new``) or with a non-digit before it is malformed and scores 0. An
untrained policy scores about 0.01 (fewer than half its responses end within ``max_new``,
and a digit is right about 1 time in 13). Prompt lengths are drawn uniformly, with no
curriculum: the short prompts are the easy ones that give the first signal.

The algorithm (Shao et al. 2024, DeepSeekMath): for each prompt sample ``G`` responses with
the current policy (:func:`sample_groups`), score them, normalise each reward within its group
(:func:`group_advantages`), broadcast the advantage to the response tokens, and minimise the
PPO clipped surrogate over response tokens only (:func:`grpo_loss`, token-mean), optionally
with a k3 KL penalty to a reference policy (off by default).

:func:`to_token_batch` turns groups into the token plane's batch format (ragged ``tokens``,
``logprobs``, ``loss_mask``, ``advantage``; fixed ``reward``, ``group``; packed plus
``lengths``) and :func:`micro_batch_loss` trains on a packed micro-batch of those fields with
its ``cu_seqlens`` (a ``cd.MicroBatch``'s ``fields``, ``cu_seqlens``, ``max_seqlen``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from conduit_dist.rl.lm import TinyLM, generate, packed_logprobs
from conduit_dist.tokens.spec import Ragged, TokenSpec

SEP, EOS, PAD = 10, 11, 12
VOCAB = 13  # digits 0..9, SEP, EOS, PAD
RAGGED = ("tokens", "logprobs", "loss_mask", "advantage")
FIXED = ("reward", "group")


@dataclass
class GRPOConfig:
    """Hyperparameters of the task and the update.

    Args:
        max_digits: the longest prompt digit string.
        group_size: responses per prompt (``G``).
        prompts_per_step: prompts (groups) sampled per step: the global batch of one
            optimiser step (per epoch).
        max_new: the most tokens a response may have (``max_digits + 1`` fits the answer).
        lr: Adam learning rate.
        clip: PPO ratio clip ``eps``.
        epochs: passes over each step's batch, one optimiser step each.
        token_budget: the most tokens per training micro-batch (a memory bound: micro-batches
            accumulate their gradients into the step, ``rl/grpo_update.py``).
        kl_coef: weight of the k3 KL penalty to a reference policy (0: off).
        adv_eps: added to the group std before dividing.
        grad_clip: gradient-norm clip (0: off).
        seed: random seed.
    """

    max_digits: int = 6
    group_size: int = 16
    prompts_per_step: int = 8
    max_new: int = 8
    lr: float = 5e-4
    clip: float = 0.2
    epochs: int = 1
    token_budget: int = 2048
    kl_coef: float = 0.0
    adv_eps: float = 1e-4
    grad_clip: float = 1.0
    seed: int = 0


def token_spec(cfg: GRPOConfig, extra: Mapping[str, tuple] | None = None) -> TokenSpec:
    """The token plane's spec of :func:`to_token_batch`'s format.

    Args:
        cfg: hyperparameters (``max_digits``, ``max_new``, ``group_size``).
        extra: more fixed per-sequence fields, ``name -> (shape, dtype)``.

    Returns:
        A :class:`TokenSpec` with the ragged and fixed fields and ``group_size``.
    """
    n = cfg.max_digits + 1 + cfg.max_new
    ragged = {"tokens": torch.int32, "logprobs": torch.float32, "loss_mask": torch.bool}
    fields: dict = {k: Ragged(d, n) for k, d in {**ragged, "advantage": torch.float32}.items()}
    fields.update(reward=((), torch.float32), group=((), torch.int64))
    fields.update(extra or {})
    return TokenSpec(fields, group="group", group_size=cfg.group_size)


def make_prompts(n: int, rng: np.random.Generator, max_digits: int = 6) -> list[list[int]]:
    """Random prompts ``d_1 .. d_k SEP`` with ``k`` uniform in ``1..max_digits``.

    Args:
        n: prompts to make.
        rng: random source.
        max_digits: the longest digit string.

    Returns:
        ``n`` token-id lists.
    """
    lengths = rng.integers(1, max_digits + 1, size=n)
    return [[*rng.integers(0, 10, size=k).tolist(), SEP] for k in lengths]


def reward(prompt: list[int], response: list[int]) -> float:
    """Partial-credit reward of a response to a reversal prompt.

    Args:
        prompt: ``d_1 .. d_n SEP``.
        response: sampled tokens (through ``EOS`` when one was emitted).

    Returns:
        ``correct / max(n, len(answer digits))`` in ``[0, 1]``; 0 when malformed (no ``EOS``,
        or a non-digit before it).

    Raises:
        ValueError: the prompt does not end with ``SEP``.
    """
    if not prompt or prompt[-1] != SEP:
        raise ValueError(f"reward: prompt must end with SEP ({SEP}), got {prompt}")
    if EOS not in response:
        return 0.0
    answer = response[: response.index(EOS)]
    if any(t > 9 for t in answer):
        return 0.0
    target = prompt[-2::-1]
    correct = sum(a == b for a, b in zip(answer, target))
    return correct / max(len(target), len(answer))


@dataclass
class Group:
    """``G`` responses to one prompt.

    Attributes:
        prompt: the prompt's token ids.
        responses: ``G`` response token-id lists (through ``EOS`` when emitted).
        logprobs: ``G`` float32 tensors, the behaviour log-prob of each response token.
        lengths: ``[G]`` int64 response lengths.
        rewards: ``[G]`` float32 rewards.
    """

    prompt: list[int]
    responses: list[list[int]]
    logprobs: list[torch.Tensor]
    lengths: torch.Tensor
    rewards: torch.Tensor


def sample_groups(
    policy: TinyLM,
    prompts: list[list[int]],
    group_size: int,
    max_new: int,
    generator: torch.Generator | None = None,
) -> list[Group]:
    """Sample ``group_size`` responses per prompt in one batch and score them.

    Args:
        policy: the current policy.
        prompts: prompt token-id lists.
        group_size: responses per prompt.
        max_new: the most tokens per response.
        generator: random source for sampling.

    Returns:
        One :class:`Group` per prompt, in order.
    """
    rows = [p for p in prompts for _ in range(group_size)]
    was_training = policy.training
    policy.eval()
    # sampled where the policy is, scored and packed on the host (one copy of each result)
    tokens, logp, lengths = (t.cpu() for t in generate(policy, rows, max_new, EOS, PAD, generator))
    policy.train(was_training)
    groups = []
    for g, prompt in enumerate(prompts):
        idx = range(g * group_size, (g + 1) * group_size)
        resp = [tokens[i, : lengths[i]].tolist() for i in idx]
        groups.append(
            Group(
                prompt=prompt,
                responses=resp,
                logprobs=[logp[i, : lengths[i]].clone() for i in idx],
                lengths=lengths[g * group_size : (g + 1) * group_size].clone(),
                rewards=torch.tensor([reward(prompt, r) for r in resp], dtype=torch.float32),
            )
        )
    return groups


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """Rewards normalised within each group: ``(r - mean) / (std + eps)``.

    Args:
        rewards: ``[groups, G]`` rewards.
        eps: added to the (population) std; a group of equal rewards gets 0.

    Returns:
        ``[groups, G]`` float32 advantages.
    """
    r = rewards.float()
    return (r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + eps)


def to_token_batch(
    groups: list[Group], group_ids: list[int] | None = None, adv_eps: float = 1e-4
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Pack groups into the token plane's batch format (prompt + response per sequence).

    Args:
        groups: sampled groups.
        group_ids: an id per group (``0..`` when None).
        adv_eps: see :func:`group_advantages`.

    Returns:
        ``batch`` with ragged ``tokens`` int32, ``logprobs`` float32 (0 on prompt tokens),
        ``loss_mask`` bool (response tokens), ``advantage`` float32 (the sequence's advantage
        on response tokens, 0 on prompt tokens), all ``[sum(lengths)]``; fixed ``reward``
        float32 and ``group`` int64, ``[B]``; and ``lengths [B]`` int64.
    """
    ids = list(range(len(groups))) if group_ids is None else list(group_ids)
    adv = group_advantages(torch.stack([g.rewards for g in groups]), adv_eps)
    cols: dict[str, list[torch.Tensor]] = {k: [] for k in RAGGED}
    lengths = []
    for gi, g in enumerate(groups):
        p = len(g.prompt)
        for j, resp in enumerate(g.responses):
            n = len(resp)
            cols["tokens"].append(torch.tensor(g.prompt + resp, dtype=torch.int32))
            cols["logprobs"].append(torch.cat([torch.zeros(p), g.logprobs[j].float()]))
            cols["loss_mask"].append(torch.arange(p + n) >= p)
            cols["advantage"].append(torch.cat([torch.zeros(p), adv[gi, j].expand(n)]))
            lengths.append(p + n)
    batch = {k: torch.cat(v) for k, v in cols.items()}
    batch["reward"] = torch.cat([g.rewards for g in groups]).float()
    batch["group"] = torch.tensor([i for i, g in zip(ids, groups) for _ in g.responses])
    return batch, torch.tensor(lengths, dtype=torch.int64)


def grpo_loss(
    new_logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantage: torch.Tensor,
    loss_mask: torch.Tensor,
    clip: float = 0.2,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    denom: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped policy-gradient loss over response tokens (token-mean).

    Args:
        new_logp: ``[T]`` log-probs under the policy being trained (differentiable).
        old_logp: ``[T]`` behaviour log-probs.
        advantage: ``[T]`` per-token advantages.
        loss_mask: ``[T]`` bool, True on response tokens.
        clip: ratio clip ``eps``: ``min(r A, clip(r, 1 - eps, 1 + eps) A)``.
        ref_logp: ``[T]`` reference-policy log-probs for the KL penalty.
        kl_coef: k3 KL weight (``exp(ref - new) - (ref - new) - 1``); 0 is off.
        denom: divide the masked sum by this (the response tokens of the whole batch when a
            batch is split into micro-batches whose gradients add up); the mask's count when
            None.

    Returns:
        The scalar loss and stats: ``pg``, ``kl``, ``clipfrac``, ``ratio`` (token means).

    Raises:
        ValueError: ``kl_coef > 0`` without ``ref_logp``.
    """
    m = loss_mask.float()
    n = float(denom) if denom is not None else max(float(m.sum()), 1.0)
    ratio = torch.exp((new_logp - old_logp) * m)
    surr = torch.minimum(ratio * advantage, ratio.clamp(1 - clip, 1 + clip) * advantage)
    pg = -(surr * m).sum() / n
    kl = torch.zeros(())
    if kl_coef > 0:
        if ref_logp is None:
            raise ValueError("grpo_loss: kl_coef > 0 needs ref_logp")
        d = (ref_logp - new_logp) * m
        kl = ((torch.exp(d) - d - 1) * m).sum() / n
    with torch.no_grad():
        cnt = max(float(m.sum()), 1.0)
        stats = {
            "pg": pg.item(),
            "kl": kl.item(),
            "clipfrac": float((((ratio - 1).abs() > clip).float() * m).sum() / cnt),
            "ratio": float((ratio * m).sum() / cnt),
        }
    return pg + kl_coef * kl, stats


def micro_batch_loss(
    policy: TinyLM,
    fields: Mapping[str, torch.Tensor],
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None,
    cfg: GRPOConfig | None = None,
    ref: TinyLM | None = None,
    denom: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The GRPO loss of one packed micro-batch (``loss.backward()`` is the caller's).

    Args:
        policy: the policy being trained.
        fields: packed ragged fields ``tokens``, ``logprobs``, ``loss_mask``, ``advantage``
            (a ``cd.MicroBatch``'s ``fields``; fixed fields are ignored).
        cu_seqlens: ``[n + 1]`` cumulative lengths.
        max_seqlen: the longest sequence (computed when None).
        cfg: hyperparameters (``clip``, ``kl_coef``); defaults when None.
        ref: reference policy for the KL penalty (needed when ``cfg.kl_coef > 0``).
        denom: see :func:`grpo_loss`.

    Returns:
        The loss and the stats of :func:`grpo_loss`.

    Raises:
        ValueError: ``cfg.kl_coef > 0`` without ``ref``.
    """
    cfg = cfg or GRPOConfig()
    tokens = fields["tokens"]
    new = packed_logprobs(policy, tokens, cu_seqlens, max_seqlen)
    ref_logp = None
    if cfg.kl_coef > 0:
        if ref is None:
            raise ValueError("micro_batch_loss: kl_coef > 0 needs a reference policy")
        with torch.no_grad():
            ref_logp = packed_logprobs(ref, tokens, cu_seqlens, max_seqlen)
    return grpo_loss(
        new,
        fields["logprobs"].float(),
        fields["advantage"].float(),
        fields["loss_mask"].bool(),
        cfg.clip,
        ref_logp,
        cfg.kl_coef,
        denom,
    )


def split_micro_batches(
    batch: Mapping[str, torch.Tensor],
    lengths: torch.Tensor,
    token_budget: int,
    order: torch.Tensor | None = None,
) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor, int]]:
    """Cut a packed batch into packed micro-batches of at most ``token_budget`` tokens.

    The single-process stand-in for the token plane's micro-batching (a sequence longer than
    the budget gets a micro-batch alone).

    Args:
        batch: ragged fields packed ``[sum(lengths)]`` and fixed fields ``[B]``.
        lengths: ``[B]`` sequence lengths.
        token_budget: the most tokens per micro-batch.
        order: a permutation of the sequences (their order when None).

    Yields:
        ``(fields, cu_seqlens int32, max_seqlen)`` per micro-batch.
    """
    starts = torch.cumsum(lengths, 0) - lengths
    order = torch.arange(len(lengths)) if order is None else order
    chunk: list[int] = []
    used = 0
    for i in [*order.tolist(), None]:
        if chunk and (i is None or used + int(lengths[i]) > token_budget):
            idx = torch.tensor(chunk)
            tok = torch.cat([torch.arange(starts[j], starts[j] + lengths[j]) for j in chunk])
            fields = {k: v[tok] if k in RAGGED else v[idx] for k, v in batch.items()}
            cu = torch.cat([torch.zeros(1), torch.cumsum(lengths[idx], 0)]).to(torch.int32)
            yield fields, cu, int(lengths[idx].max())
            chunk, used = [], 0
        if i is not None:
            chunk.append(i)
            used += int(lengths[i])
