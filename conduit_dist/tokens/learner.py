"""A token plane's learner side (``TokenLearner``): its takes (``stream``, ``fetch``), the
next take's first round launched ahead (``fetch_start``, ``attach``: ``tokens/ahead.py``), and
priority updates. The facade (``tokens/plane.py``) delegates to it; rounds run through the
plane's ``TokenRunner``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch
from torch import nn

from conduit_dist.errors import ConfigError, EmptyStoreError, RoundError, SpecError
from conduit_dist.sched.hooks import BackwardTrigger
from conduit_dist.syncs import SYNCS
from conduit_dist.tokens.ahead import Key, TakeTiming
from conduit_dist.tokens.batch import MicroBatch
from conduit_dist.tokens.round import Request


class TokenLearner:
    """What a learner rank does with a token plane.

    Args:
        runner: the plane's ``TokenRunner``.
        store: this rank's shard (its ``token_cap``).
        pacer: the plane's pacing (its global batch).
        learners: the learner ranks; rank: this rank.
        version: this rank's policy version now (the plane's; it changes as it publishes).
        closed: whether the plane is closed now.
    """

    def __init__(
        self, runner, store, pacer, learners: tuple[int, ...], rank: int,
        version: Callable[[], int], closed: Callable[[], bool],
    ) -> None:  # fmt: skip
        self.runner, self.ahead, self.store, self.pacer = runner, runner.ahead, store, pacer
        self.learners, self.rank = learners, rank
        self._version, self._closed = version, closed
        self.last_take: TakeTiming | None = None

    def take(
        self, n: int, budget: int, produce, wait_s: float, streaming: bool
    ) -> Iterator[MicroBatch]:
        """``stream`` (``streaming``) or ``fetch``'s micro-batches (see ``TokenPlane.stream``)."""
        self.check(n, budget)
        key = (n, budget, streaming)
        pending = self.ahead.pending
        if pending is not None and pending.key != key:
            raise ConfigError(
                f"stream/fetch: a round was launched ahead for (num_groups, token_budget, "
                f"stream) = {pending.key}, got {key}; keep them fixed between steps"
            )
        self.ahead.armed = None
        timing = self.last_take = TakeTiming()
        start, left = time.monotonic(), n
        launched = self.runner.take(key, time.perf_counter(), timing)
        if launched is not None:
            out, stats = launched
            left -= stats.groups
            if not left:  # the batch is complete: the next backward launches the next one
                self.ahead.armed = key
            yield from out
        while left:
            closed_by = self.runner.closed_by
            if time.monotonic() - start > wait_s:
                raise EmptyStoreError(
                    f"stream: {n - left} of {n} groups delivered after "
                    f"{wait_s:.0f} s (wait_s); are the producers putting "
                    "whole groups and calling flush()?"
                )
            if closed_by >= 0:
                raise RoundError(
                    f"stream: rank {closed_by} closed the plane with {left} of {n} groups "
                    "undelivered",
                    round=self.runner.engine.round,
                )
            if produce is not None:
                produce()
            piece = len(self.learners) if streaming else left
            t0 = time.perf_counter()
            out, stats = self.runner.run(Request(left, budget, piece), self._version())
            timing.rounds += 1
            timing.exposed_ms += (time.perf_counter() - t0) * 1e3
            left -= stats.groups
            if not left:  # the batch is complete: the next backward launches the next one
                self.ahead.armed = key
            yield from out
            if left and self.runner.closed_by >= 0:
                raise RoundError(
                    f"stream: rank {self.runner.closed_by} closed the plane with {left} of "
                    f"{n} groups undelivered",
                    round=self.runner.engine.round,
                )

    def fetch_start(self, n: int, budget: int, stream: bool, next_version: bool) -> None:
        """Launch the next take's first round now (see ``TokenPlane.fetch_start``).

        Raises:
            ConfigError: on a non-learner rank, a bad argument, or a round launched already.
        """
        self.check(n, budget)
        if self.ahead.pending is not None:
            raise ConfigError("fetch_start: a round was launched already; take it first")
        self._launch((n, budget, bool(stream)), next_version)

    def attach(self, module: nn.Module) -> None:
        """Launch each global batch's first round when ``module``'s backward starts (see
        ``TokenPlane.attach``).

        Raises:
            ConfigError: on a non-learner rank, or a module attached already.
        """
        if self.rank not in self.learners:
            raise ConfigError(f"attach: rank {self.rank} is not a learner; producers flush")
        if self.ahead.trigger is not None:
            raise ConfigError("attach: a module is attached already; call detach() first")
        self.ahead.trigger = BackwardTrigger(module, self._on_backward, lambda a, b: None)

    def detach(self) -> None:
        """Remove the backward hooks (a round launched already is still taken next)."""
        if self.ahead.trigger is not None:
            self.ahead.trigger.remove()
            self.ahead.trigger = None

    def _on_backward(self) -> None:
        """At a backward start: launch the armed next take's first round, once."""
        key = self.ahead.armed
        if key is None or self._closed() or self.runner.closed_by >= 0:
            return
        if self.ahead.pending is None:
            self._launch(key, next_version=True)

    def _launch(self, key: Key, next_version: bool) -> None:
        """Launch the take ``key``'s first round on the round thread; where rounds enqueue NCCL
        work from that thread, return once its exchange is enqueued (``TokenRunner.launch``)."""
        n, budget, streaming = key
        req = Request(n, budget, len(self.learners) if streaming else n)
        self.ahead.armed = None
        self.runner.launch(key, req, self._version(), next_version, gate=self.runner.one_thread)

    def check(self, n: int, budget: int) -> None:
        """A learner's take arguments.

        Raises:
            ConfigError: on a non-learner rank, a bad count or budget, a count pacing does not
                expect, or a budget above the plane's ``token_cap``.
        """
        if self.rank not in self.learners:
            raise ConfigError(
                f"stream/fetch: rank {self.rank} is not a learner (learner_ranks="
                f"{list(self.learners)}); producers call flush()"
            )
        for name, v in (("num_groups", n), ("token_budget", budget)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name}: expected an int >= 1, got {v!r}")
        if self.pacer.on and n != self.pacer.per_batch:
            raise ConfigError(
                f"num_groups: pacing by version assumes one global batch of "
                f"groups_per_batch = {self.pacer.per_batch} groups per version, "
                f"got {n}"
            )
        cap = self.store.token_cap
        if cap is not None and budget > cap:  # refused here, before any round runs
            raise ConfigError(
                f"token_budget: expected at most token_cap = {cap} (the most tokens a "
                f"micro-batch may hold), got {budget}"
            )

    def update_priorities(self, batch: MicroBatch, priority: torch.Tensor) -> None:
        """Queue each group's replay priority for the next round (see
        ``TokenPlane.update_priorities``).

        Raises:
            SpecError: unless one finite priority >= 0 per sequence.
        """
        if "_key" in batch.host:  # as the round knew them: no read of the device
            gid, holder = batch.host["_key"].tolist(), batch.host["_holder"].tolist()
        else:
            gid, holder = batch["_key"].tolist(), batch["_holder"].tolist()
        if priority.is_cuda:  # the next round's table carries them on the host
            SYNCS.add("token priorities")
        pr = priority.detach().to("cpu", torch.float64).reshape(-1)
        if pr.shape[0] != batch.sequences or not bool(torch.isfinite(pr).all() & (pr >= 0).all()):
            raise SpecError(
                f"update_priorities: expected {batch.sequences} finite priorities >= 0 "
                f"(one per sequence), got {pr.shape[0]} with min "
                f"{float(pr.min()) if pr.numel() else 'n/a'}"
            )
        self.runner.queue_priorities(holder, gid, pr.tolist())  # given to the next round
