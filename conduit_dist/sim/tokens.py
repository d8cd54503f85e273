"""One steady-state token round (LLM RL, ``TokenPlane``) on a declared machine.

Built with the token plane's own parts, priced by the plane's model (no formula of its own):

- the round's meta all-gather: each rank's row of ``tokens/round.py`` (``META_WIDTH`` plus its
  group table, ``select.WIDTH`` int64 per group, sized by the plane's power-of-two hint), priced
  as the all-to-all it is;
- the weights: a new version once per round (one policy version per global batch), as the
  plane sends it: each learner's part (about ``1/L`` of the bytes) to every generator
  (``WeightsState.exchange``, ``sim.rounds.weights_matrix``);
- the selection: every learner's ``groups_per_learner`` prompt groups of ``group_size``
  sequences with long-tailed lengths (lognormal, capped), held by the generators in completion
  order, planned over the learners by :func:`conduit_dist.tokens.balance.plan` (token-balanced,
  groups never split) and sized on the wire by :class:`conduit_dist.tokens.wire.Wire` (no
  padding), then priced as the plane's ``Transport`` prices it (``BandwidthModel.choose``);
- the bookkeeping of a round of that many exchanges (the topology's terms), as for replay
  rounds.

The learner's step (``step_ms``) is what the round can hide behind: the round for the next
batch runs while the learners train on this one (streaming), so the part over the step is
exposed. That includes the weights transfer, which assumes generators may run one version
behind (``max_policy_age >= 1``); strictly on-policy, generators wait for it in full.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from conduit_dist.errors import ConfigError
from conduit_dist.sim.rounds import SimRound, bookkeeping_s, price_exchange, weights_matrix
from conduit_dist.sim.topology import SimTopology
from conduit_dist.tokens import balance
from conduit_dist.tokens import select as S
from conduit_dist.tokens.round import META_WIDTH
from conduit_dist.tokens.spec import Ragged, TokenSpec
from conduit_dist.tokens.wire import Wire


@dataclass(frozen=True)
class TokenWorkload:
    """An LLM-RL job's round: generators put prompt groups, learners take a token-balanced
    batch and publish new weights.

    Attributes:
        name: short name.
        params_b: model parameters, billions (weights sent as bf16: 2 bytes each).
        group_size: sequences per prompt group (GRPO's samples per prompt).
        groups_per_learner: prompt groups per learner per step (weak scaling: the global batch
            grows with the learners).
        median_tokens: median sequence length (prompt + response).
        sigma: the lengths' lognormal shape (long tail).
        max_tokens: the longest sequence (lengths are capped here).
        learner_every: every ``k``-th rank learns, the others generate.
        token_budget: tokens per micro-batch.
        step_ms: the learners' step (forward, backward, optimizer) the round hides behind.
    """

    name: str
    params_b: float
    group_size: int = 16
    groups_per_learner: int = 4
    median_tokens: int = 600
    sigma: float = 0.8
    max_tokens: int = 8192
    learner_every: int = 2
    token_budget: int = 16_384
    step_ms: float = 1000.0

    def __post_init__(self) -> None:
        for key in ("group_size", "groups_per_learner", "median_tokens", "max_tokens",
                    "learner_every", "token_budget"):  # fmt: skip
            if getattr(self, key) < 1:
                raise ConfigError(
                    f"token workload {self.name!r} {key}: expected >= 1, got {getattr(self, key)}"
                )
        if not self.params_b > 0 or not self.sigma >= 0:
            raise ConfigError(
                f"token workload {self.name!r}: expected params_b > 0 and sigma >= 0, got "
                f"{self.params_b} and {self.sigma}"
            )

    @property
    def weights_bytes(self) -> int:
        """Bytes of one published version (bf16)."""
        return int(self.params_b * 1e9 * 2)

    def spec(self) -> TokenSpec:
        """The sequences' fields: token ids and their log-probabilities per token, a reward
        per sequence (plus the group id the spec adds)."""
        return TokenSpec(
            {
                "tokens": Ragged(torch.int32, self.max_tokens),
                "logprobs": Ragged(torch.float32, self.max_tokens),
                "reward": ((), torch.float32),
            },
            group_size=self.group_size,
        )


def simulate_tokens(
    topo: SimTopology, world: int, w: TokenWorkload, seed: int = 0, model=None
) -> SimRound:
    """Simulate one steady-state token round of ``w`` on ``world`` ranks of ``topo``.

    Returns:
        The round (``schedule="tokens"``): meta gather, weights transfer, token delivery.

    Raises:
        ConfigError: a world with no generator.
    """
    links = topo.links(world)
    model = model if model is not None else topo.model(world)
    learners = np.arange(0, world, w.learner_every)
    producers = np.setdiff1d(np.arange(world), learners)
    if not len(producers):
        raise ConfigError(f"token workload {w.name!r}: no generator at world {world}")
    r = SimRound(world, "tokens", backward_s=w.step_ms * 1e-3)
    rng = np.random.default_rng(seed)
    n_groups = w.groups_per_learner * len(learners)
    lengths = rng.lognormal(np.log(w.median_tokens), w.sigma, (n_groups, w.group_size))
    lengths = np.clip(lengths.astype(np.int64), 1, w.max_tokens)
    tokens = lengths.sum(axis=1)
    holder = producers[np.arange(n_groups) % len(producers)]  # completion order over generators
    # meta: every rank's row with its table (the batch in hand and as much still generating)
    held = -(-2 * n_groups // len(producers))
    hint = max(16, 1 << max(held - 1, 0).bit_length())
    meta = np.full((world, world), (META_WIDTH + hint * S.WIDTH) * 8, dtype=np.int64)
    np.fill_diagonal(meta, 0)
    r.exchanges.append(price_exchange("all_gather(meta)", meta, links, model, fixed="all_to_all"))
    weights = weights_matrix(world, w.weights_bytes, learners, producers)  # every learner a part
    r.exchanges.append(price_exchange("send(weights)", weights, links, model, fixed="p2p"))
    plan = balance.plan(tokens, len(learners), w.token_budget)
    dest = np.empty(n_groups, dtype=np.int64)
    for li, mbs in enumerate(plan):
        dest[[i for mb in mbs for i in mb]] = learners[li]
    pair = holder * world + dest  # sequences and tokens per (holder, learner)
    n = np.bincount(pair, minlength=world * world).reshape(world, world) * w.group_size
    t = np.bincount(pair, weights=tokens, minlength=world * world).reshape(world, world)
    t = t.astype(np.int64)
    wire, nbytes = Wire(w.spec()), np.zeros((world, world), np.int64)
    for a, b in zip(*np.nonzero(n), strict=True):
        nbytes[a, b] = wire.nbytes(int(n[a, b]), int(t[a, b]))
    r.exchanges.append(price_exchange("deliver(tokens)", nbytes, links, model))
    r.cpu_s = bookkeeping_s(topo, world, 2)  # meta and delivery (weights: sends alone)
    return r
