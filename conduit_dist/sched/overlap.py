"""Which round a fetch or flush owns, and when it runs: inline, or launched at backward.

Every fetch (learners) and flush (actors) owns exactly one round, so every rank runs the same
number of rounds whatever each one's schedule. In ``overlap`` mode a learner's next round is
launched when its module's backward starts and a flush's round runs in the background; the call
that owns a launched round waits for it. ``schedule="auto"`` times both modes on each rank, on
learners at every fetch and on actors at every flush, and keeps the faster.
"""

from __future__ import annotations

import logging
import threading

import torch
from torch import nn

from conduit_dist.errors import ConfigError, EmptyStoreError, RateLimitError
from conduit_dist.rounds.tickets import RoundStats
from conduit_dist.sampling.base import Takes
from conduit_dist.sched.auto import AutoTrial
from conduit_dist.sched.clock import RoundClock
from conduit_dist.sched.hooks import BackwardTrigger
from conduit_dist.sched.scheduler import Scheduler, now
from conduit_dist.sched.timeline import Timeline

log = logging.getLogger("conduit_dist")


class OverlapController:
    """Drives a plane's rounds from fetch, flush and the learner's backward.

    Args:
        clock: numbers and prepares rounds.
        sched: runs them.
        overlap: start in ``overlap`` mode (else ``sync``).
        trial: the ``auto`` trial, or ``None``.
        max_lag: ``0``: launch at backward only between ``fetch(..., more=True)`` minibatches.
        rank: this rank.
        seed: the run seed (a batch smaller than its round is a seeded random subset).
        is_learner: whether this rank fetches.
    """

    def __init__(
        self,
        clock: RoundClock,
        sched: Scheduler,
        overlap: bool,
        trial: AutoTrial | None,
        max_lag: int,
        rank: int = 0,
        seed: int = 0,
        is_learner: bool = True,
    ) -> None:
        self.clock, self.sched, self.trial = clock, sched, trial
        self.overlap, self.max_lag = overlap, max_lag
        self.rank, self.is_learner = rank, is_learner
        self._subset_gen = torch.Generator().manual_seed(int(seed) + 7 * rank)
        self.last: tuple | None = None  # what the latest fetch's FetchTiming is computed from
        self.trigger: BackwardTrigger | None = None
        self._fetched = False  # a fetch happened since the last launch at backward
        self._last_batch = 0
        self._more = False
        self._started = False  # the pending round was started by fetch_start

    @property
    def chosen_schedule(self) -> str:
        """The schedule in force on this rank (``auto (trial)`` until the trial is over)."""
        if self.trial is not None and self.trial.choice is None:
            return "auto (trial)"
        return "overlap" if self.overlap else "sync"

    def fetch(
        self,
        batch_size: int,
        more: bool,
        reduce: torch.Tensor | None = None,
        oversample: bool = False,
    ) -> torch.Tensor:
        """This fetch's ``batch_size`` records (see :meth:`DataPlane.fetch`); accounts its time.

        Raises:
            EmptyStoreError: if nothing is stored yet, or (unless ``oversample``) fewer items
                than ``batch_size`` for a sampler that draws with replacement.
            ConfigError: on an actor, a bad ``batch_size``, or more rows than the round launched
                at backward holds.
        """
        if not self.is_learner:
            raise ConfigError(
                f"fetch: rank {self.rank} is an actor; actors call flush() once per iteration"
            )
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size: expected an int >= 1, got {batch_size!r}")
        if reduce is not None:
            self.sched.engine.check_payload(reduce)
        t_wait = now()
        records, stats, prefetched, lag = self._fetch_round(batch_size, more, reduce)
        rows = records.shape[0]
        sampler = self.sched.engine.sampler
        if rows > batch_size and isinstance(sampler, Takes):
            raise ConfigError(
                f"fetch: batch_size {batch_size} is smaller than the {rows} items the "
                f"{sampler.name!r} sampler delivered to the round launched for it; keep the "
                "batch size fixed"
            )
        if rows == 0 and stats.limited:
            lim = self.sched.engine.limiter
            raise RateLimitError(
                f"fetch({batch_size}) on rank {self.rank} in round {stats.round}: held by "
                + lim.holds("sample", batch_size, stats.stored)
            )
        if rows == 0 and stats.stored:
            raise EmptyStoreError(
                f"fetch({batch_size}) on rank {self.rank} in round {stats.round}: "
                + sampler.empty_reason(batch_size, stats.stored)
            )
        if rows == 0:
            raise EmptyStoreError(
                f"fetch({batch_size}) on rank {self.rank} in round {stats.round}: the store is "
                "empty (0 items over all shards); put experience before fetching"
            )
        if not oversample and stats.stored < batch_size and not isinstance(sampler, Takes):
            raise EmptyStoreError(
                f"fetch({batch_size}) on rank {self.rank} in round {stats.round}: the store "
                f"holds {stats.stored} item(s) over all shards, fewer than the batch (its rows, "
                "drawn with replacement, would repeat); put more first, fetch with wait_s= to "
                "run rounds until it holds enough, or pass oversample=True to allow it"
            )
        if rows < batch_size:
            how = "started by fetch_start" if self._started else "launched for it at backward"
            raise ConfigError(
                f"fetch: batch_size {batch_size} is larger than the {rows} items of the round "
                f"{how}; keep the batch size fixed, or use schedule='sync' without fetch_start"
            )
        if rows > batch_size:  # a uniform random subset of i.i.d. draws is i.i.d. too
            keep = torch.randperm(rows, generator=self._subset_gen)[:batch_size]
            records = records.index_select(0, keep.to(records.device))
        t_end = now()
        self.last = (stats, prefetched, lag, t_wait, t_end)
        self.clock.timeline.add("fetch (waiting)", Timeline.LEARNER, t_wait, t_end)
        return records

    def _fetch_round(
        self, batch_size: int, more: bool, reduce: torch.Tensor | None
    ) -> tuple[torch.Tensor, RoundStats, bool, int]:
        """This fetch's round: ``(records, stats, prefetched, lag)``."""
        t = now()
        pending = self.sched.pending
        if pending is not None and pending.kind == "prefetch":
            if reduce is not None:  # never averaged: the round carries fetch_start's payload
                raise ConfigError(
                    "fetch: reduce= given, but this fetch's round was started already (by "
                    "fetch_start or at backward) and carries the payload given then; pass "
                    "reduce to fetch_start"
                )
            p, records, stats = self.clock.wait()
            prefetched, lag = True, int(self.clock.stager.put_seq > p.put_seq)
        else:
            if pending is not None:  # an overlapped flush's round: finish it first
                self.clock.wait()
            records, stats = self.clock.run(batch_size, reduce)
            prefetched, lag = False, 0
        self._started = False
        self._fetched, self._last_batch, self._more = True, batch_size, more
        self._tick(t)
        return records, stats, prefetched, lag

    def fetch_start(self, batch_size: int, reduce: torch.Tensor | None) -> None:
        """Start the next fetch's round now, on this thread, and leave its exchange in flight
        (see :meth:`DataPlane.fetch_start`).

        Raises:
            ConfigError: on an actor, a bad ``batch_size``, a plane without one-exchange rounds,
                in ``overlap`` mode, or when a round is in flight already.
        """
        if not self.is_learner:
            raise ConfigError(f"fetch_start: rank {self.rank} is an actor; actors call flush()")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size: expected an int >= 1, got {batch_size!r}")
        if self.sched.engine.schedule != "fused":
            raise ConfigError(
                "fetch_start: needs one-exchange rounds to leave in flight (a placement that keeps "
                "items where they were put, world size > 1), got the "
                f"{self.sched.engine.schedule!r} schedule: its exchanges depend on each other"
            )
        if self.overlap or (self.trial is not None and self.trial.choice is None):
            raise ConfigError(
                f"fetch_start: expected schedule='sync', got {self.chosen_schedule!r} (rounds "
                "launched at backward and early-started rounds would compete for the next fetch)"
            )
        if self.sched.pending is not None:
            raise ConfigError("fetch_start: a round is in flight already; fetch its batch first")
        if reduce is not None:
            self.sched.engine.check_payload(reduce)
        ticket = self.clock.prepare(batch_size, reduce)
        self._launch_gated(ticket, "prefetch", self.sched.start)
        self._fetched, self._last_batch, self._started = False, batch_size, True

    def _launch_gated(self, ticket, kind: str, how) -> None:
        """Launch (or start) a round; where its NCCL work goes through the round thread, return
        only once that work is enqueued (``Scheduler.gate``): NCCL work the caller issues next
        on another communicator then follows it on every rank."""
        if self.sched.round_thread:
            ticket.enqueued = threading.Event()
        self.clock.guard(lambda: how(ticket, kind, self.clock.stager.put_seq))
        if ticket.enqueued is not None:
            self.clock.guard(lambda: self.sched.gate(ticket))

    def poll(self) -> None:
        """Note whether a round started by :meth:`fetch_start` is still in flight (``put``
        calls it: the exchange's time so far was hidden behind the caller's work)."""
        self.sched.poll()

    def flush(self) -> None:
        """An actor's round (see :meth:`DataPlane.flush`)."""
        self._tick(now())
        pending = self.sched.pending
        if pending is not None:
            self.clock.wait()
            if pending.kind == "prefetch":  # launched at backward: it is this call's round
                return
        if self.overlap:
            self._launch_gated(self.clock.prepare(0), "flush", self.sched.launch)
        else:
            self.clock.run(0)

    def wait(self) -> None:
        """Finish an overlapped flush's round; a round launched at backward stays attributed to
        the next fetch (this waits until it is done, and raises if it failed)."""
        pending = self.sched.pending
        if pending is None:
            return
        if pending.kind == "flush":
            self.clock.wait()
            return
        self.sched.settle()
        if not pending.future.done() or pending.future.exception() is not None:
            # a failed (or hung) prefetched round raises now, not at some later fetch, and
            # nothing reads the runner's state while it may still be inside the round
            self.clock.wait()

    def quiesce(self) -> None:
        """Finish an overlapped flush's round, and let a round launched at backward finish
        (it stays for its fetch); raise if it failed.

        Raises:
            RuntimeError: if the launched round is still running after ``timeout_s``: peers on
                ``sync`` join it only at their next fetch (the plane stays usable).
        """
        pending = self.sched.pending
        if pending is None or pending.kind == "flush":
            self.wait()
            return
        self.sched.settle(self.sched.timeout_s)
        if not pending.future.done():
            raise RuntimeError(
                f"round {pending.ticket.round}, launched at this rank's backward, is still "
                f"running after {self.sched.timeout_s:.0f}s: ranks on schedule='sync' join it "
                "only at their next fetch; call this where no round is in flight (before the "
                "backward), or run every rank on the same schedule"
            )
        self.wait()

    def quiet(self) -> None:
        """:meth:`quiesce`, then order the caller's stream after every round's device work and
        the next round after the caller's (``Scheduler.join``): the storage may be read or
        written outside a round now (a state dict, a checkpoint's snapshot, a restore)."""
        self.quiesce()
        if self.clock.cuda is not None:
            self.sched.join()

    def closing_round(self) -> None:
        """Every rank's last round: a round launched at backward serves as it, else one runs."""
        pending = self.sched.pending
        if pending is not None:
            self.clock.wait()
        if pending is None or pending.kind != "prefetch":
            self.clock.run(0)

    def attach(self, module: nn.Module) -> None:
        """Launch the next fetch's round when ``module``'s backward starts.

        Raises:
            ConfigError: if a module is attached already.
        """
        if self.trigger is not None and self.trigger.attached:
            raise ConfigError("attach: a module is attached already; call detach() first")
        timeline = self.clock.timeline

        def forward_span(start: float, end: float) -> None:
            timeline.add("forward", Timeline.LEARNER, start, end)

        # a fixed sync schedule with no trace: the hooks could never launch or record anything
        trying = self.trial is not None and self.trial.choice is None
        active = self.overlap or trying or timeline.enabled
        self.trigger = BackwardTrigger(module, self._on_backward, forward_span, active)

    def state_dict(self) -> dict[str, object]:
        """The schedule in force on this rank and the auto trial's choice."""
        choice = self.trial.choice if self.trial is not None else None
        return {"overlap": self.overlap, "choice": choice or ""}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict`: a finished auto trial is not run again."""
        if self.trial is not None and state["choice"]:
            self.trial.choice = str(state["choice"])
            self.overlap = self.trial.choice == "overlap"
            trigger = self.trigger
            if trigger is None or not trigger.attached:
                return
            if self.overlap:
                trigger.activate()  # hooks taken off when this process's trial chose sync
            elif not self.clock.timeline.enabled:
                trigger.deactivate()  # a restored sync choice: the hooks can do nothing

    def detach(self) -> None:
        """Remove the hooks (a launched round still completes at the next call)."""
        if self.trigger is not None:
            self.trigger.remove()
            self.trigger = None

    def _on_backward(self) -> None:
        t = now()
        self.clock.timeline.add("backward start", Timeline.LEARNER, t, t)
        clock = self.clock  # closed, failed or inside a staged() block: launch nothing
        if not self.overlap or clock.closed or clock.failed is not None or clock.stager.in_block:
            return
        if self.sched.pending is not None or not self._fetched:
            return
        if self.max_lag == 0 and not self._more:
            return
        self._fetched = False
        # NCCL rows: enqueued before this backward's own collectives, on every rank
        self._launch_gated(self.clock.prepare(self._last_batch), "prefetch", self.sched.launch)

    def _tick(self, t: float) -> None:
        """Feed the auto trial the iteration that ended at ``t``; follow its mode."""
        if self.trial is None:
            return
        mode = self.trial.tick(t, "overlap" if self.overlap else "sync")
        if mode is not None:
            self.overlap = mode == "overlap"
            if self.trial.choice is not None:
                log.info("rank %d: %s", self.rank, self.trial.describe())
                # settled on sync with no trace: the hooks have nothing left to do
                if (
                    not self.overlap
                    and self.trigger is not None
                    and not self.clock.timeline.enabled
                ):
                    self.trigger.deactivate()
