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
from collections import Counter


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


def wait_event(event, reason: str) -> None:
    """Block the host until ``event`` (a ``torch.cuda.Event``, or ``None``) has passed; counted
    under ``reason`` only when it had not passed yet."""
    if event is None or event.query():
        return
    SYNCS.add(reason)
    event.synchronize()
