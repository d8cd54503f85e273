"""The plane's round clock: numbers rounds, prepares their tickets, records how they went.

Every rank runs the same rounds in the same order; the clock is where a rank's rounds are counted
(one per fetch, flush or closing call), where a round's ticket is snapshotted from the stager and
the weights, and where the first failure is kept so that every later call raises it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from conduit_dist.errors import RoundError
from conduit_dist.rounds.tickets import RoundStats, RoundTicket
from conduit_dist.sched.scheduler import Pending, Scheduler
from conduit_dist.sched.timeline import Timeline

T = TypeVar("T")


class RoundClock:
    """Round numbering, tickets and failure state of one plane.

    Args:
        stager: the plane's stager (what a round ingests).
        weights: the plane's weights state (what a round broadcasts).
        versions: the rank's policy versions (a ticket's ``newest``).
        sched: runs rounds inline or on the worker.
        timeline: where each round's phases are recorded.
        device: the plane's device (CUDA: tickets carry the consumer's stream and an event).
    """

    def __init__(
        self, stager, weights, versions, sched: Scheduler, timeline: Timeline, device: torch.device
    ) -> None:
        self.stager, self.weights, self.sched, self.timeline = stager, weights, sched, timeline
        self.versions = versions
        self.cuda = device if device.type == "cuda" else None
        self.round = 0  # rounds prepared so far (the next round's number)
        self.stats = RoundStats()  # the latest finished round
        self.failed: RoundError | None = None
        self.closed = False  # set by assembly.release: no round may be launched any more
        self._newest = 0  # the previous ticket's newest version

    def prepare(self, request: int, reduce: torch.Tensor | None = None) -> RoundTicket:
        """Snapshot what the next round moves (on the thread that owns ``put``)."""
        staged, device_staged, direct = self.stager.take()
        ticket = RoundTicket(
            self.round, request, staged, direct, self.weights.snapshot(), device_staged
        )
        ticket.reduce = reduce
        ticket.newest = self.versions.newest
        ticket.newest_before, self._newest = self._newest, ticket.newest
        if self.cuda is not None:
            self._cuda_ticket(ticket)
        self.round += 1
        return ticket

    def _cuda_ticket(self, ticket: RoundTicket) -> None:
        """CUDA: the events a round is ordered by, recorded on the consumer's current stream,
        with no host sync. Pooled delivery buffers nobody holds now get a release event (every
        kernel that read them is before it: ``OutputPool.release_point``), and the round's side
        stream waits for this stream only where it reads what this stream wrote."""
        sched = self.sched
        engine = sched.engine
        engine.delivery.outputs.release_point()
        on_gpu = engine.storage.tiers[0].data.is_cuda
        if ticket.writes_on_device() or (ticket.direct and on_gpu) or sched.touched:
            ticket.ready = torch.cuda.current_stream(self.cuda).record_event()
            sched.touched = False

    def guard(self, fn: Callable[[], T]) -> T:
        """Call ``fn`` (a round); any failure is kept, so every later call raises it.

        A round that failed half-way (a collective, or a local error such as out of memory)
        leaves this rank out of step with its peers, so the plane cannot go on: a local error is
        raised as a :class:`RoundError` naming the round, chained to the cause.
        """
        try:
            return fn()
        except RoundError as exc:
            self.failed = exc
            raise
        except Exception as exc:
            r = self.round - 1
            self.failed = RoundError(
                f"round {r} failed on rank {self.sched.engine.rank}: {type(exc).__name__}: {exc}", r
            )
            raise self.failed from exc

    def run(
        self, request: int, reduce: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, RoundStats]:
        """Prepare a round and run it inline."""
        ticket = self.prepare(request, reduce)
        out, stats = self.guard(lambda: self.sched.run(ticket))
        self.finish(stats)
        return out, stats

    def wait(self) -> tuple[Pending, torch.Tensor, RoundStats]:
        """Wait for the launched round (raising its failure)."""
        p, out, stats = self.guard(self.sched.wait)
        self.finish(stats)
        return p, out, stats

    def finish(self, stats: RoundStats) -> None:
        """Record a finished round."""
        self.stats = stats
        if self.timeline.enabled:
            for phase, (a, b) in stats.spans.items():
                self.timeline.add(phase, Timeline.PLANE, a, b, round=stats.round)

    def state_dict(self) -> dict[str, int]:
        """The round number and the newest policy version of the latest ticket."""
        return {"round": self.round, "newest": self._newest}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore :meth:`state_dict`."""
        self.round, self._newest = int(state["round"]), int(state["newest"])

    def check(self) -> None:
        """Raise the kept failure, if any.

        Raises:
            RoundError: naming the round that failed.
        """
        if self.failed is not None:
            raise RoundError(
                f"the DataPlane failed in round {self.failed.round} and cannot continue: "
                f"{self.failed}",
                self.failed.round,
                self.failed.ranks,
            )
