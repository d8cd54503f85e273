"""Heartbeats: marks in the rendezvous store of the last round (or phase) each rank reached,
read back after a failure to name the ranks that never arrived."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
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
