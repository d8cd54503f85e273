"""Host weights between the ranks of one host through ``/dev/shm`` (a token plane with
``transport.shared_memory`` on): each learner packs its part of a version straight into a file
of its own, and a round's receivers copy every learner's part out of those files. Nothing
crosses a socket, and the pack is the whole of the sender's transfer.

A learner's files are named ``conduit-<token>-w<rank>-<slot>-<bytes>`` (the token the plane's
shared memory agreed at start-up), sized like the whole buffer but sparse: the learner packs only
its part (a learner serving an ingress also copies the others' parts in), so only those pages
are allocated. Without storage use counts (an old torch) a file is never packed again: each
version gets a new one. Files of an old layout's size stay until the plane closes.

Receivers that only load whole weights (producers) do not copy the parts out: they read them in
place (``WeightsState`` holds the version as :class:`InFiles`, a ``pull`` copies or views straight
out of the learners' files), so each round's meta carries the versions each rank still reads from
files (``held``: the one it holds whole, the one it is pulling, and the oldest and newest its
modules loaded in place view: every version between them counts as viewed). A file is packed again
only when nothing on its owner holds it (its publish, a round's snapshot: storage use counts), no
receiver can still be reading the round that sent it (that round is older than the newest round
whose meta its owner gathered: every rank had finished that round's predecessors by then), and no
rank reported reading the version in it in that meta (a rank starts reading a version only while it
holds it whole, which it reports from the round after the one that sent it). Files are removed at
the plane's close or at interpreter exit (mappings elsewhere stay valid); receivers open them
without ``O_CREAT``.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import mmap
import os
import threading
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from conduit_dist.collectives.shm import SHM_DIR
from conduit_dist.errors import ConfigError
from conduit_dist.records.buffers import Pooled


class _File:
    """One of a learner's files, mapped: its slot, size, the mapping (pooled: its use count
    tells whether anything on this rank holds it), the last round that sent it and the version
    packed into it."""

    __slots__ = ("nbytes", "pooled", "sent", "slot", "version")

    def __init__(self, slot: int, nbytes: int, pooled: Pooled) -> None:
        self.slot, self.nbytes, self.pooled, self.sent, self.version = slot, nbytes, pooled, -1, 0


@dataclass(frozen=True)
class InFiles:
    """A whole version a receiver reads in place: each owner's byte ranges in that owner's
    mapped file (every file is the whole buffer's size; the first piece's holds the header),
    sorted by ``lo``, with the ``(rank, slot)`` of each piece's file."""

    nbytes: int
    pieces: tuple[tuple[int, int, torch.Tensor], ...]  # (lo, hi, the owner's file)
    keys: tuple[tuple[int, int], ...]  # each piece's file: (owner rank, slot)

    def head(self) -> torch.Tensor:
        """A file holding the header (the first owner's), the whole buffer's size."""
        return self.pieces[0][2]

    def span(self, lo: int, hi: int) -> torch.Tensor | None:
        """Bytes ``[lo, hi)`` as a view of the one file holding all of them (``None``: they
        straddle owners)."""
        i = bisect.bisect_right(self._starts, lo) - 1
        if i < 0:
            return None
        a, b, f = self.pieces[i]
        return f[lo:hi] if a <= lo and hi <= b else None

    def read(self, lo: int, hi: int, out: torch.Tensor) -> None:
        """Copy bytes ``[lo, hi)`` into ``out`` (``hi - lo`` bytes), piece by piece."""
        i = max(0, bisect.bisect_right(self._starts, lo) - 1)
        for a, b, f in self.pieces[i:]:
            if a >= hi:
                break
            x, y = max(a, lo), min(b, hi)
            if x < y:
                out[x - lo : y - lo].copy_(f[x:y])

    def whole(self, out: torch.Tensor) -> torch.Tensor:
        """The buffer, copied into ``out`` (``nbytes``)."""
        self.read(0, self.nbytes, out)
        return out

    def private(self, files: WeightFiles) -> InFiles:
        """The same pieces on copy-on-write mappings of the same files, fresh: what a module
        loaded in place views, so a write to it never reaches the owners' files."""
        maps: dict[tuple[int, int], torch.Tensor] = {}
        pieces = []
        for (lo, hi, _), key in zip(self.pieces, self.keys):
            if key not in maps:
                maps[key] = files.peer(*key, self.nbytes, private=True)
            pieces.append((lo, hi, maps[key]))
        return InFiles(self.nbytes, tuple(pieces), self.keys)

    @functools.cached_property
    def _starts(self) -> list[int]:
        return [p[0] for p in self.pieces]


def _map(path: str, nbytes: int, create: bool, private: bool = False) -> torch.Tensor:
    """``path`` mapped shared (created sparse with ``nbytes`` bytes where ``create``), or
    ``private``: copy on write, so writes through it never reach the file (reads see the file
    until a page is written)."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
        share = mmap.MAP_PRIVATE if private else mmap.MAP_SHARED
        mm = mmap.mmap(fd, nbytes, share, mmap.PROT_READ | mmap.PROT_WRITE)
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
        # the versions any rank reported reading from files in that meta, and the ranges of
        # versions its modules view
        self.held: set[int] = set()
        self.viewed: list[tuple[int, int]] = []
        self._lock = threading.Lock()  # publishes (the caller's thread) and rounds (the plane's)

    def path(self, rank: int, slot: int, nbytes: int) -> str:
        """The file of ``rank``'s ``slot`` holding buffers of ``nbytes``."""
        return os.path.join(SHM_DIR, f"conduit-{self.token}-w{rank}-{slot}-{nbytes}")

    def take(self, nbytes: int, version: int) -> tuple[int, torch.Tensor]:
        """A file of ``nbytes`` to pack ``version`` into: one nobody holds or reads (on this
        rank, in a round, or in place on a receiver), else a new one. Returns its slot and a
        tensor on its mapping (holding it while it lives).

        Raises:
            ConfigError: if ``/dev/shm`` cannot hold a new file.
        """
        with self._lock:
            for f in self._mine:
                if (
                    f.nbytes == nbytes and f.pooled.idle is not None  # use counts known
                    and f.pooled.free() and f.sent < self.gathered
                    and f.version not in self.held
                    and not any(a <= f.version <= b for a, b in self.viewed)
                ):  # fmt: skip
                    f.version = version
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
            f.version = version
            self._mine.append(f)
            return slot, buf.detach()

    def gathered_at(self, round: int, held: set[int], viewed: list[tuple[int, int]]) -> None:
        """Round ``round``'s meta is here: every rank finished the rounds before it; ``held``
        are the versions ranks reported reading in place, ``viewed`` the ``[oldest, newest]``
        versions each rank's modules view."""
        with self._lock:
            self.gathered, self.held, self.viewed = round, held, viewed

    def sent(self, slot: int, nbytes: int, round: int) -> None:
        """``round`` sends this rank's file ``slot``: not packed again before every rank has
        finished that round (its successor's meta gathered)."""
        with self._lock:
            for f in self._mine:
                if f.slot == slot and f.nbytes == nbytes:
                    f.sent = round

    def peer(self, rank: int, slot: int, nbytes: int, private: bool = False) -> torch.Tensor:
        """``rank``'s file ``slot`` of ``nbytes``, mapped shared (kept for later rounds; only
        read here), or ``private``: a fresh copy-on-write mapping (see :class:`InFiles`).

        Raises:
            ConfigError: if it does not exist (its owner closed or died).
        """
        key = (rank, slot, nbytes)
        got = None if private else self._peers.get(key)
        if got is None:
            path = self.path(rank, slot, nbytes)
            try:
                got = _map(path, nbytes, create=False, private=private)
                if not private:
                    self._peers[key] = got
            except FileNotFoundError as exc:
                raise ConfigError(
                    f"weights: rank {rank}'s weights file {path} is gone (its rank closed or died)"
                ) from exc
        return got

    def close(self) -> None:
        """Remove this rank's files (mappings held elsewhere stay valid until dropped)."""
        _remove(self._owned)
        self._mine, self._peers = [], {}
