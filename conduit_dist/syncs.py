"""The host syncs the library makes on purpose, counted by reason.

A host sync (the host waiting for the GPU) stalls the thread that makes it and, on the learner's
thread, drains the queue of work the GPU had ahead. The CUDA path makes none per round in steady
state; the few it may make (a pending copy's event not passed yet when its buffer comes back, a
host read of link columns that only exist on the device) go through :func:`wait_event` or
:meth:`SyncCounter.add`, so each is counted with its reason (``DataPlane.store_stats()``'s
``host_syncs``, the GPU check's budget). An event already passed costs nothing and counts
nothing. torch's own syncs are counted separately by ``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

from conduit_dist.errors import RoundError


class SyncCounter:
    """Host syncs by reason (thread-safe: rounds, demoters and checkpoints count from their
    threads)."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, reason: str, n: int = 1) -> None:
        """Count ``n`` host syncs for ``reason``."""
        with self._lock:
            self._counts[reason] += n

    def snapshot(self) -> dict[str, int]:
        """The counts so far (a copy)."""
        with self._lock:
            return dict(self._counts)

    def total(self) -> int:
        """All host syncs so far."""
        with self._lock:
            return sum(self._counts.values())


SYNCS = SyncCounter()
"""The process's counter (a rank is a process)."""


_limit_s: float | None = None  # the longest a library host sync waits (allow)
DEFAULT_LIMIT_S = 300.0  # before any plane said


def allow(seconds: float) -> None:
    """Let the library's host syncs wait up to ``seconds`` (a plane calls it with twice its
    collectives' timeout; the longest any plane of the process asked for applies)."""
    global _limit_s
    _limit_s = seconds if _limit_s is None else max(_limit_s, seconds)


def wait_event(event, reason: str, limit_s: float | None = None) -> None:
    """Block the host until ``event`` (a ``torch.cuda.Event``, or ``None``) has passed; counted
    under ``reason`` only when it had not passed yet. The wait polls the event (a yield for the
    first 50 us, then a tenth of the time waited, at most 1 ms) and gives up after the limit
    (``limit_s``, else :func:`allow`'s): the device work before it is stuck (a collective whose
    peer is gone), and waiting on would only end when NCCL's watchdog ends the process.

    Raises:
        RoundError: naming ``reason`` and the limit, when the event has not passed by then.
    """
    if event is None or event.query():
        return
    SYNCS.add(reason)
    if limit_s is None:
        limit_s = _limit_s if _limit_s is not None else DEFAULT_LIMIT_S
    limit = limit_s
    start = time.monotonic()
    while not event.query():
        waited = time.monotonic() - start
        if waited > limit:
            raise RoundError(
                f"{reason}: a CUDA event has not passed after {limit:g}s (the device work "
                "before it is stuck: a collective whose peer is gone, or a kernel that does not "
                "end); the plane cannot go on",
                round=-1,
            )
        time.sleep(0.0 if waited < 50e-6 else min(0.1 * waited, 1e-3))
