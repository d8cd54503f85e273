"""A token plane's producer side (``TokenProducer``): ``put`` (checked whole, stored on this
rank's shard), and pacing by version (``reserve``, ``allowance``). The facade
(``tokens/plane.py``) delegates to it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from conduit_dist.errors import ConfigError, SpecError
from conduit_dist.tokens.spec import TokenSpec, check_batch


class TokenProducer:
    """What a producer rank does with a token plane.

    Args:
        spec: the plane's token spec.
        runner: the plane's ``TokenRunner`` (a launched round owns the store until it ended).
        store: this rank's shard.
        pacer: the plane's pacing.
        versions: this rank's ``TokenVersions``.
        rank: this rank.
        learner: whether this rank is a learner (a producer-only rank pulls weights).
        flush: one round asking for nothing (``False`` once a rank closed the plane).
    """

    def __init__(
        self, spec: TokenSpec, runner, store, pacer, versions, rank: int, learner: bool,
        flush: Callable[[], bool],
    ) -> None:  # fmt: skip
        self.spec, self.runner, self.store, self.pacer = spec, runner, store, pacer
        self.versions, self.rank, self.learner, self.flush = versions, rank, learner, flush

    def put(self, batch: Mapping[str, torch.Tensor], lengths, version, token_versions) -> None:
        """See ``TokenPlane.put``."""
        self.runner.settle()  # the store is a launched round's until it ended
        self.runner.before_write()  # CUDA: the arenas after the rounds' reads (on the device)
        v = self.versions.version if version is None else int(version)
        try:
            packed = check_batch(self.spec, batch, lengths, v, token_versions)
        except SpecError:  # a reserved group that will never arrive must not hold a place
            gids = batch.get(self.spec.group) if isinstance(batch, Mapping) else None
            if isinstance(gids, torch.Tensor):
                self.store.cancel(gids.reshape(-1).tolist())
            raise
        self.store.add(packed)

    def reserve(self, group_ids: Sequence[int], model: nn.Module | None) -> int | None:
        """See ``TokenPlane.reserve``."""
        self.runner.settle()
        ids = [int(g) for g in group_ids]
        if self.runner.closed_by >= 0:
            return None
        if model is None and self.pacer.on and not self.learner:
            raise ConfigError(
                "reserve: expected model= on a producer-only rank (pacing counts "
                "the version of the weights it generates with, which pull_weights "
                "advances), got None"
            )
        while True:
            if model is not None and not self.learner:
                self.versions.pull(model)
            version = self.versions.version
            if self.pacer.allows(len(ids), version):
                self.store.reserve(ids, version)
                self.pacer.started += len(ids)
                return version
            if self.runner.ahead.pending is not None:  # waiting runs rounds: the take's first
                raise ConfigError(
                    f"reserve: {len(ids)} groups need a round to wait for, but a round launched "
                    f"for the next fetch/stream holds its micro-batches; reserve at most "
                    f"allowance()={self.allowance()} groups until that take, or take it first"
                )
            if not self.flush():
                return None

    def allowance(self) -> int | None:
        """See ``TokenPlane.allowance``."""
        if not self.pacer.producer:
            raise ConfigError(f"allowance: rank {self.rank} is not in producer_ranks")
        if not self.pacer.on:
            return None
        return max(0, self.pacer.window(self.versions.version) - self.pacer.started)
