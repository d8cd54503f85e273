"""Host weights between the ranks of one host through ``/dev/shm`` (a token plane with
``transport.shared_memory`` on): each learner packs its part of a version straight into a file
of its own, and a round's receivers copy every learner's part out of those files. Nothing
crosses a socket, and the pack is the whole of the sender's transfer.

A learner's files are named ``conduit-<token>-w<rank>-<slot>-<bytes>`` (the token the plane's
shared memory agreed at start-up), sized like the whole buffer but sparse: the learner packs only
its part (a learner serving an ingress also copies the others' parts in), so only those pages
are allocated. Without storage use counts (an old torch) a file is never packed again: each
version gets a new one. Files of an old layout's size stay until the plane closes.

A file is packed again only when nothing on its owner holds it (its publish, a round's
snapshot: storage use counts) and no receiver can still be copying from it: the round that last
sent it is older than the newest round whose meta its owner gathered (every rank had finished
that round's predecessors by then). Files are removed at the plane's close or at interpreter
exit; receivers open them without ``O_CREAT``.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import weakref

import numpy as np
import torch

from conduit_dist.collectives.shm import SHM_DIR
from conduit_dist.errors import ConfigError
from conduit_dist.records.buffers import Pooled


class _File:
    """One of a learner's files, mapped: its slot, size, the mapping (pooled: its use count
    tells whether anything on this rank holds it) and the last round that sent it."""

    __slots__ = ("nbytes", "pooled", "sent", "slot")

    def __init__(self, slot: int, nbytes: int, pooled: Pooled) -> None:
        self.slot, self.nbytes, self.pooled, self.sent = slot, nbytes, pooled, -1


def _map(path: str, nbytes: int, create: bool) -> torch.Tensor:
    """``path`` mapped shared (created sparse with ``nbytes`` bytes where ``create``)."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))


def _remove(paths: list[str]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    paths.clear()


class WeightFiles:
    """This rank's weight files (as a learner) and its mappings of its peers' (as a receiver).

    Args:
        token: the name part every rank of the plane's shared memory agreed on.
        rank: this rank.
    """

    def __init__(self, token: str, rank: int) -> None:
        self.token, self.rank = token, rank
        self._mine: list[_File] = []
        self._peers: dict[tuple[int, int, int], torch.Tensor] = {}  # (rank, slot, bytes)
        self._owned: list[str] = []
        weakref.finalize(self, _remove, self._owned)
        self.gathered = 0  # the newest round whose meta this rank gathered
        self._lock = threading.Lock()  # publishes (the caller's thread) and rounds (the plane's)

    def path(self, rank: int, slot: int, nbytes: int) -> str:
        """The file of ``rank``'s ``slot`` holding buffers of ``nbytes``."""
        return os.path.join(SHM_DIR, f"conduit-{self.token}-w{rank}-{slot}-{nbytes}")

    def take(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """A file of ``nbytes`` to pack a new version into: one nobody holds or reads, else a
        new one. Returns its slot and a tensor on its mapping (holding it while it lives).

        Raises:
            ConfigError: if ``/dev/shm`` cannot hold a new file.
        """
        with self._lock:
            for f in self._mine:
                if (
                    f.nbytes == nbytes and f.pooled.idle is not None  # use counts known
                    and f.pooled.free() and f.sent < self.gathered
                ):  # fmt: skip
                    return f.slot, f.pooled.buf.detach()
            slot = max((f.slot for f in self._mine), default=-1) + 1
            path = self.path(self.rank, slot, nbytes)
            try:
                buf = _map(path, nbytes, create=True)
            except OSError as exc:
                raise ConfigError(
                    f"transport.shared_memory: rank {self.rank} could not make a {nbytes}-byte "
                    f"weights file in {SHM_DIR} ({exc.strerror}); make {SHM_DIR} larger or set "
                    "shared_memory=False"
                ) from exc
            self._owned.append(path)
            f = _File(slot, nbytes, Pooled(buf))
            self._mine.append(f)
            return slot, buf.detach()

    def sent(self, slot: int, nbytes: int, round: int) -> None:
        """``round`` sends this rank's file ``slot``: not packed again before every rank has
        finished that round (its successor's meta gathered)."""
        with self._lock:
            for f in self._mine:
                if f.slot == slot and f.nbytes == nbytes:
                    f.sent = round

    def peer(self, rank: int, slot: int, nbytes: int) -> torch.Tensor:
        """``rank``'s file ``slot`` of ``nbytes``, mapped (kept for later rounds).

        Raises:
            ConfigError: if it does not exist (its owner closed or died).
        """
        key = (rank, slot, nbytes)
        got = self._peers.get(key)
        if got is None:
            path = self.path(rank, slot, nbytes)
            try:
                got = self._peers[key] = _map(path, nbytes, create=False)
            except FileNotFoundError as exc:
                raise ConfigError(
                    f"weights: rank {rank}'s weights file {path} is gone (its rank closed or died)"
                ) from exc
        return got

    def close(self) -> None:
        """Remove this rank's files (mappings held elsewhere stay valid until dropped)."""
        _remove(self._owned)
        self._mine, self._peers = [], {}
