"""Heartbeats and waits: marks in the rendezvous store of the last round (or phase) each rank
reached, read back after a failure to name the ranks that never arrived; and the two ways a wait on
a collective gives up at the plane's deadline (gloo's timed ``wait``, marking only if it outlasts a
grace; polling for NCCL)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger("conduit_dist")

# how long asking the store who is behind may take (the store's own timeout is restored after)
_QUERY_TIMEOUT = timedelta(seconds=2)
# what a dead or unreachable store raises: DistNetworkError when the TCPStore server is gone
# ("Broken pipe", "Connection was likely closed"), DistStoreError on a store timeout or a
# FileStore whose file was removed. Anything else (a malformed mark) is a bug and propagates.
_STORE_DOWN = (dist.DistNetworkError, dist.DistStoreError)
# gloo rounds mark their heartbeat lazily: a wait first gives its collective this long, and only a
# wait that outlasts it writes the mark (a store round trip, ~0.05 ms, is then off the fast path);
# collectives only: a send/recv work's timed wait that expires closes the pairs (wait_gloo)
_GRACE = timedelta(milliseconds=50)
# a polled wait only yields for its first 50 us, then sleeps a tenth of the time waited so far,
# at most 1 ms: a collective is seen done within ~10% (and 1 ms) of its time, and the waiting
# thread mostly sleeps
_POLL_SPIN_S, _POLL_FRACTION, _POLL_CAP_S = 50e-6, 0.1, 1e-3


class Heartbeats:
    """Marks in the rendezvous store: the last round (or phase) each rank reached.

    Each rank writes its own key per channel (``round``, ``phase``); after a failure any rank can
    read every rank's mark and name those behind. When the store is missing or stops answering,
    marks and queries are skipped and one warning says that failures cannot name ranks.

    Args:
        store: the rendezvous store, or ``None`` when there is none.
        prefix: key prefix, unique per plane.
        rank: this rank.
        world: number of ranks.
        missing: why there is no store (logged once, on rank 0, when ``store`` is ``None``).
    """

    def __init__(
        self, store: dist.Store | None, prefix: str, rank: int, world: int, missing: str = ""
    ) -> None:
        self.store, self.prefix, self.rank, self.world = store, prefix, rank, world
        self._warned = False
        if store is None and world > 1 and rank == 0:  # the same on every rank: say it once
            self._unavailable(missing or "no rendezvous store")

    def _key(self, channel: str, rank: int) -> str:
        return f"{self.prefix}{channel}/{rank}"

    def mark(self, channel: str, value: int) -> None:
        """Record that this rank reached ``value`` on ``channel``."""
        if self.store is None or self.world == 1:
            return
        try:
            self.store.set(self._key(channel, self.rank), str(value))
        except _STORE_DOWN as exc:  # the collective will fail and say so; only naming is lost
            self._unavailable(f"the rendezvous store refused this rank's mark ({_brief(exc)})")

    def behind(self, channel: str, value: int) -> tuple[int, ...]:
        """Ranks whose last mark on ``channel`` is below ``value`` (empty if the store cannot say).

        The query runs with a short store timeout, restored afterwards (the default store is
        shared by the whole process: its timeout is not ours to keep).
        """
        if self.store is None or self.world == 1:
            return ()
        keys = [self._key(channel, r) for r in range(self.world)]
        try:
            with _store_timeout(self.store, _QUERY_TIMEOUT):
                seen = [int(self.store.get(k)) if self.store.check([k]) else -1 for k in keys]
        except _STORE_DOWN as exc:
            self._unavailable(f"the rendezvous store did not answer ({_brief(exc)})")
            return ()
        return tuple(r for r, s in enumerate(seen) if s < value)

    def _unavailable(self, reason: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning(
                "rank %d: failures cannot name the ranks that never arrived: %s", self.rank, reason
            )


def _default_store() -> tuple[dist.Store | None, str]:
    """The default group's rendezvous store, or ``None`` and why (a private torch API)."""
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get is None:
        return None, (
            "torch.distributed.distributed_c10d._get_default_store is missing in torch "
            f"{torch.__version__}, so no heartbeats are written"
        )
    return get(), ""


@contextlib.contextmanager
def _store_timeout(store: dist.Store, timeout: timedelta) -> Iterator[None]:
    """Use ``timeout`` for the store's calls inside the block, then restore the previous one.

    Without ``Store.timeout`` (older torch) the previous value cannot be read back, so the store's
    own timeout is left as it is.
    """
    previous = getattr(store, "timeout", None)
    if previous is None:
        yield
        return
    store.set_timeout(timeout)
    try:
        yield
    finally:
        store.set_timeout(previous)


def _brief(exc: BaseException) -> str:
    """An exception's type and first line (store errors append a C++ stack trace)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def wait_gloo(work: dist.Work, timeout: timedelta, mark: Callable[[], None] | None) -> bool:
    """Wait for a gloo work with gloo's ``wait(timeout)``. With ``mark``, first give it a 50 ms
    grace and call ``mark()`` only if it outlasts that (a rank blocked in a round has marked it
    long before any timeout).

    The grace is for works whose timed wait can be repeated: a gloo collective's (all-to-all,
    all-reduce, broadcast, gather: c10d's ``Work::wait(timeout)`` waits on the work's condition
    variable and raises "Operation timed out!", the collective running on) and shared memory's
    (``ShmWork.wait``). Never a send/recv work's: ``ProcessGroupGloo::SendWork::wait(timeout)``
    (and ``RecvWork``'s) is gloo's ``UnboundBuffer::waitSend(timeout)``, which on expiry calls
    ``context_->signalException("Application timeout caused pair closure")``, closing every
    pair of the group, and the work finishes with that error. Those are waited with ``mark``
    ``None``: once, with the full timeout (``Exchange.send_recv``).

    Args:
        work: the collective's work.
        timeout: how long the (second) wait may take.
        mark: writes this rank's heartbeat, or ``None``.

    Returns:
        ``False`` where the wait reported a timeout without raising.

    Raises:
        RuntimeError: the work's error, or gloo's timeout.
    """
    if mark is not None:
        try:
            if work.wait(_GRACE):
                return True
        except RuntimeError as exc:
            if "timed out" not in str(exc).lower():
                raise
        mark()  # still waiting: say this rank got here
    return work.wait(timeout) is not False


def wait_polling(work: dist.Work, deadline: float) -> bool:
    """Wait for a work of a group with NCCL: poll ``is_completed()`` until ``deadline``.

    NCCL's ``work.wait()`` makes the current CUDA stream wait for the collective and returns:
    a peer that never arrives would surface at the next synchronisation (never) or when NCCL's
    watchdog ends the process. Polling the work's completion (its CUDA event) lets the plane
    raise its own error first (the group's watchdog waits ``dist.watchdog_timeout``: twice the
    plane's timeout plus a margin). ``wait()`` after completion orders the current stream after
    the collective and raises its error, if any. A gloo work of the same group (CPU tensors)
    is waited on the same way.

    Args:
        work: the collective's work.
        deadline: a ``time.monotonic()`` value.

    Returns:
        Whether the work completed by the deadline.

    Raises:
        RuntimeError: the work's error.
    """
    if not poll_until(work.is_completed, deadline):
        return False
    work.wait()
    return True


def poll_pause(waited: float) -> float:
    """How long a polled wait sleeps before its next check, having waited ``waited`` seconds:
    nothing (a yield) for the first 50 us, then a tenth of ``waited``, at most 1 ms. A check
    after a pause comes at most that pause after the work completed, so the latency a poll
    adds stays within 10% of the time waited (and 1 ms); a doubling schedule (20 us up to
    1 ms) saw a collective that completed at 1.3 ms ~1 ms late.

    Args:
        waited: seconds since the wait began.

    Returns:
        Seconds to sleep (0: yield the GIL and check again).
    """
    if waited < _POLL_SPIN_S:
        return 0.0
    return min(_POLL_FRACTION * waited, _POLL_CAP_S)


def poll_until(done: Callable[[], bool], deadline: float) -> bool:
    """Call ``done()`` until it returns true or ``time.monotonic()`` passes ``deadline``,
    pausing between checks as :func:`poll_pause` says.

    Args:
        done: the check (``work.is_completed``).
        deadline: a ``time.monotonic()`` value.

    Returns:
        Whether ``done()`` returned true (checked once more at the deadline).
    """
    start = time.monotonic()
    while not done():
        now = time.monotonic()
        left = deadline - now
        if left <= 0:
            return bool(done())
        time.sleep(min(poll_pause(now - start), left))
    return True
