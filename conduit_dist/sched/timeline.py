"""Exposed / hidden accounting per fetch, and a per-rank Chrome trace (viewable in Perfetto)."""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field

from conduit_dist.errors import ConfigError

_T0 = time.perf_counter()
PHASES = ("ingest", "sample", "deliver", "weights")


@dataclass
class FetchTiming:
    """Where one fetch's experience-path time went (milliseconds, this rank).

    Attributes:
        round: the round that delivered the batch.
        prefetched: whether the round was launched before ``fetch`` (during backward).
        lag_rounds: rounds of puts on this rank the batch may miss (0 or 1; never above max_lag).
        exposed_ms: time the learner waited inside ``fetch``.
        hidden_ms: round time that ran before ``fetch`` was called (overlapped with compute);
            for a round started by ``fetch_start``, the time its exchange was seen running
            while the caller worked before the fetch (``RoundStats.flight``, in the ingest phase).
        phases: per phase, ``(exposed_ms, hidden_ms)``.
    """

    round: int
    prefetched: bool
    lag_rounds: int
    exposed_ms: float
    hidden_ms: float
    phases: dict[str, tuple[float, float]] = field(default_factory=dict)


def fetch_timing(stats, prefetched: bool, lag: int, t_wait: float, t_end: float) -> FetchTiming:
    """Split a fetch's round into exposed and hidden time, per phase.

    Args:
        stats: the round's ``RoundStats`` (phase spans in ``perf_counter`` seconds).
        prefetched: whether the round was launched before the fetch.
        lag: rounds of this rank's puts the batch may miss.
        t_wait: when the fetch started waiting.
        t_end: when it returned.
    """
    phases = {p: split(stats.spans[p], (t_wait, t_end)) for p in PHASES if p in stats.spans}
    if stats.flight is not None and "ingest" in phases:  # the exchange ran behind the caller
        launched, end = stats.flight  # until the fetch began: from then on it is exposed
        e, h = phases["ingest"]
        phases["ingest"] = (e, h + max(0.0, min(end, t_wait) - launched))
    return FetchTiming(
        round=stats.round,
        prefetched=prefetched,
        lag_rounds=lag,
        exposed_ms=(t_end - t_wait) * 1e3,
        hidden_ms=sum(h for _, h in phases.values()) * 1e3,
        phases={p: (e * 1e3, h * 1e3) for p, (e, h) in phases.items()},
    )


def split(interval: tuple[float, float], wait: tuple[float, float]) -> tuple[float, float]:
    """Split ``interval`` into (exposed, hidden) seconds: exposed is its overlap with ``wait``."""
    a, b = interval
    exposed = max(0.0, min(b, wait[1]) - max(a, wait[0]))
    return exposed, max(0.0, (b - a) - exposed)


class Timeline:
    """Per-rank events for a Chrome trace: learner phases and data-plane phases on separate tracks.

    Args:
        rank: this rank (the trace's process id).
        max_events: events kept (oldest dropped first).
        enabled: record events (off: ``add`` returns at once).
    """

    LEARNER, PLANE = 1, 2

    def __init__(self, rank: int, max_events: int = 200_000, enabled: bool = True) -> None:
        self.rank = rank
        self.enabled = enabled
        self.max_events = max_events
        self.events: list[dict] = []
        self._lock = threading.Lock()

    def add(self, name: str, track: int, start: float, end: float, **args: object) -> None:
        """Record a complete event (``perf_counter`` seconds)."""
        if not self.enabled:
            return
        ev = {
            "name": name,
            "ph": "X",
            "pid": self.rank,
            "tid": track,
            "ts": (start - _T0) * 1e6,
            "dur": max(end - start, 0.0) * 1e6,
            "args": args,
        }
        with self._lock:
            self.events.append(ev)
            if len(self.events) > self.max_events:
                del self.events[: len(self.events) - self.max_events]

    def export(self, path: str) -> str:
        """Write the trace as Chrome trace JSON; returns the path.

        Raises:
            ConfigError: if tracing is off.
        """
        if not self.enabled:
            raise ConfigError("export_trace: tracing is off; build the plane with trace=True")
        meta = [
            {
                "name": "process_name",
                "ph": "M",
                "pid": self.rank,
                "args": {"name": f"rank {self.rank}"},
            },
            {
                "name": "thread_name",
                "ph": "M",
                "pid": self.rank,
                "tid": self.LEARNER,
                "args": {"name": "learner phases"},
            },
            {
                "name": "thread_name",
                "ph": "M",
                "pid": self.rank,
                "tid": self.PLANE,
                "args": {"name": "data plane (collectives)"},
            },
        ]
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with self._lock:
            events = meta + list(self.events)
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
        return path
