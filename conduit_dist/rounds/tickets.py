"""What a round moves and what it reports: :class:`RoundTicket` (snapshotted when a round is
prepared) and :class:`RoundStats` (filled in as it runs)."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from conduit_dist.collectives.transport import Move
from conduit_dist.flow.weights import WeightsSnapshot
from conduit_dist.records.buffers import RecordBuffer
from conduit_dist.records.spec import ExperienceSpec


@dataclass
class RoundStats:
    """What one round did and how long each phase took (milliseconds, this rank).

    ``spans`` holds each phase's ``(start, end)`` in ``time.perf_counter`` seconds, for the
    exposed/hidden split and the trace.
    """

    round: int = -1
    """The round's number."""
    newest: int = 0  # the newest policy version the rank knew when the round was prepared
    newest_before: int = 0  # the same at the previous round (what actors know in this one)
    limited: bool = False  # the rate limiter held this rank's request back
    ingest_ms: float = 0.0
    sample_ms: float = 0.0
    deliver_ms: float = 0.0
    weights_ms: float = 0.0
    """Each phase's milliseconds."""
    flight: tuple[float, float] | None = None
    """An early-started round (``fetch_start``): ``(launch, end)`` in ``perf_counter`` seconds,
    its exchange running behind the caller from its launch at least until ``end``: the latest
    check that found it running (``put`` and the fetch's check), or its completion where the
    transport says when (shared memory: the last rank's arrival). ``fetch_timing`` counts the
    span up to the fetch's own start as hidden (over gloo a lower bound)."""
    cpu_ms: float = 0.0
    """CPU time of the thread that ran the round (``time.thread_time``; gloo's own threads,
    which move the bytes, are not in it)."""
    thread: str = ""
    """The thread that ran the round (``conduit-round...``: the plane's round thread)."""
    gate_ms: float = 0.0
    """A round launched at backward on a plane whose rows go by NCCL: how long the backward
    hook waited until the round's NCCL work was enqueued (so it precedes the backward's own
    collectives, e.g. DDP's, in the same order on every rank)."""
    items_in: int = 0
    items_out: int = 0
    """Items this shard received, and this rank was delivered."""
    bytes_in: int = 0
    bytes_out: int = 0
    """The same in bytes."""
    stored: int = 0
    """Items over all shards after the round."""
    sent: np.ndarray | None = None
    """Bytes this rank's round sent each rank (index: destination; ``None``: nothing moved):
    to its peers over the wire (a one-exchange round's headers, candidates and payload too), to
    itself by local copy (its own items into its shard, its shard's rows into its own batch).
    The weights' broadcast is not in it."""
    spans: dict[str, tuple[float, float]] = field(default_factory=dict)
    moves: list[Move] = field(default_factory=list)

    def add_sent(self, per_rank: np.ndarray) -> None:
        """Add bytes sent to each rank (``[world]``) to :attr:`sent`."""
        per_rank = np.asarray(per_rank, dtype=np.int64)
        self.sent = per_rank.copy() if self.sent is None else self.sent + per_rank

    @property
    def total_ms(self) -> float:
        """Wall time of the whole round."""
        return self.ingest_ms + self.sample_ms + self.deliver_ms + self.weights_ms

    def mark(self, phase: str, start: float, end: float) -> None:
        """Record a phase's span and duration."""
        self.spans[phase] = (start, end)
        setattr(self, f"{phase}_ms", (end - start) * 1e3)

    def as_dict(self) -> dict[str, float]:
        """Plain dict of the numbers, with ``total_ms``."""
        d = asdict(self)
        d.pop("spans")
        d.pop("moves")
        d.pop("sent")
        d.pop("thread")
        return {**d, "total_ms": self.total_ms}


@dataclass
class RoundTicket:
    """Everything a round moves, snapshotted when it was prepared."""

    round: int
    request: int
    staged: RecordBuffer
    direct: int
    weights: WeightsSnapshot
    device_staged: RecordBuffer | None = None  # CUDA: items put from GPU tensors
    # CUDA: an event on the consumer's stream when the round was prepared, recorded only where
    # the round reads what that stream wrote (device staging, donated CUDA tensors, rows put
    # into device slots, a device payload); the round's side stream waits for it
    ready: object = None
    reduce: torch.Tensor | None = None  # float32 [reduce_numel]: averaged over learners in place
    newest: int = 0  # the newest policy version this rank knew (max_policy_age's reference)
    newest_before: int = 0  # ``newest`` of this rank's previous ticket
    # set once the round's NCCL work is enqueued (or it ended): a backward hook that launched
    # it waits for that, so the plane's NCCL calls precede the backward's own on every rank
    enqueued: threading.Event | None = None
    gate_ms: float = 0.0  # how long that wait took

    def buffers(self) -> tuple[RecordBuffer, ...]:
        """The staging buffers the round reads."""
        return tuple(b for b in (self.staged, self.device_staged) if b is not None)

    def writes_on_device(self) -> bool:
        """Whether the round reads what the consumer's CUDA stream wrote: device staging, a
        donated batch of CUDA tensors, a CUDA payload (rows put into device slots are checked
        by the caller, which knows the slots' device)."""
        dev = self.device_staged
        if dev is not None and dev.count:
            return True
        if self.reduce is not None and self.reduce.is_cuda:
            return True
        return any(t.is_cuda for _, b in self.staged.deferred for t in b.values())

    @property
    def count(self) -> int:
        """Items staged for this round (host and device staging)."""
        dev = self.device_staged
        return self.staged.count + (dev.count if dev is not None else 0)

    def pack_deferred(self, spec: ExperienceSpec) -> None:
        """Pack donated batches into their staging rows (on the round's stream)."""
        self.staged.pack_deferred(spec)
        if self.device_staged is not None:
            self.device_staged.pack_deferred(spec)
