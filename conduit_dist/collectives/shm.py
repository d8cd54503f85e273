"""All-to-all of host rows between the ranks of one host through shared memory
(``TransportConfig(shared_memory="auto")``, the default: on where every rank is on one host;
start-up and that decision are in ``shm_open.py``).

gloo moves host tensors between processes over TCP, on one host too: every byte crosses the
loopback socket, copied by the kernel on each side, and every call pays the socket round trips.
Here each rank owns one file in ``/dev/shm`` (mapped by every rank of the group), split in two
halves used by alternate exchanges. An exchange writes this rank's rows for each peer into its
half after a small header of byte offsets (one per destination), arrives at the barrier, and,
once every rank has arrived, copies each peer's rows for this rank out of that peer's half. The
own rows are copied directly. Nothing is pickled, and no socket is involved.

The barrier is a control block in shared memory (``_native/shmbar.c``): one slot per rank with
the last exchange it arrived at and its file generation, a futex to sleep on. Arriving writes
the slot and wakes the sleepers; waiting spins for 30 us, then sleeps on the missing peer's
futex (the GIL released), checking the deadline and the peer's liveness every 2 ms. Liveness:
each rank holds a POSIX lock on its byte of the control file for as long as it lives, so a
waiter sees at once that a peer exited (its lock is gone) and fails naming it; a peer that is
alive but late fails the wait at the plane's timeout, named too. The control file is created by
rank 0 at start-up and unlinked as soon as every rank has mapped and locked it: nothing of it
outlives the processes.

Why two halves are enough: a rank writes a half again two exchanges later, after the barrier of
the exchange in between, which every peer enters only once it has finished reading the exchange
before it. (So a peer is at most one exchange ahead: each slot keeps the generation for
exchanges of each parity.) A half too small makes a new, larger file (the next generation, twice
the size at least). Every peer maps a new generation as soon as an exchange's barrier publishes
it (whether or not it reads from it then), so the file's name is unlinked at the next exchange's
barrier: the mappings outlive it, and a job killed by a signal leaves nothing in ``/dev/shm``,
unless it dies within the two exchanges after a growth (then ``rm /dev/shm/conduit-*``). A
peer's file is opened without ``O_CREAT`` (never recreated by a reader). Files are named
``conduit-<token>-<rank>-<generation>`` (the token agreed at start-up); what is still named is
removed at :meth:`SharedMemory.close` (a plane's ``close`` runs a barrier first, so no peer
still reads) or at interpreter exit. Space is reserved with ``posix_fallocate`` before any byte is
written, so a full ``/dev/shm`` fails with a clear error, never with a ``SIGBUS``: the rank
that hit it still arrives at the exchange's barrier with generation -1, and every peer fails the
exchange naming it.

Which exchanges use it: every all-to-all of host tensors (the meta all-gather, which runs as an
all-to-all; the header exchange, writing its send rows in place; ingestion and delivery where
the ``all_to_all`` strategy runs them). The ``p2p``, ``chunked4`` and ``gather`` strategies,
broadcasts and rows on the GPU still go through the group. Files only grow: each rank's holds
two halves of at least its largest exchange so far (calibration probes included).

Every rank must call :meth:`SharedMemory.start` for the same exchanges in the same order (as for
any collective); waiting (:class:`ShmWork`) has the plane's timeout. Linux only (futex); the
native extension is required (``pip install -e .``).
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import time
import weakref
from datetime import timedelta

import numpy as np
import torch

from conduit_dist.errors import ConfigError
from conduit_dist.records.native import _native

SHM_DIR = "/dev/shm"
_ALIGN = 64  # each block starts on a cache line
_SLOT = 64  # bytes per rank in the control block (shmbar.c)


def _offsets(splits: list[int]) -> list[int]:
    return [0, *itertools.accumulate(splits)]


def header_bytes(world: int) -> int:
    """Bytes of a half's header in a group of ``world`` ranks (an int64 offset per destination,
    rounded up to a cache line)."""
    return -(-world * 8 // _ALIGN) * _ALIGN


def half_bytes(need: int, cap: int) -> int:
    """The halves of the file a rank makes when an exchange needs ``need`` bytes of a half and
    its halves hold ``cap`` (twice the old at least, 64 KiB at least, cache-line aligned)."""
    return -(-max(need, 2 * cap, 1 << 16) // _ALIGN) * _ALIGN


def _row_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size() // t.shape[0] if t.dim() and t.shape[0] else 0


class ShmWork:
    """One exchange's arrival at the barrier; the first successful :meth:`wait` copies this
    rank's rows out of the peers' halves. A wait that timed out may be retried, as gloo's may
    (the exchange's 50 ms grace does); any other failure, and an exchange's final one
    (``Exchange._fail``), leave the transport ``broken``: no later exchange runs."""

    def __init__(self, shm: SharedMemory, seq: int, finish, keep: tuple = ()) -> None:
        self._shm, self.seq, self._finish, self.done = shm, seq, finish, False
        self._keep = keep  # the tensors finish() copies into by address: alive until it ran
        self.completed_at: float | None = None  # once waited: when the last rank arrived

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for every rank to have written, then read what the peers wrote for this rank.

        Raises:
            RuntimeError: at the timeout (naming the ranks that never arrived), or at once when
                a missing rank exited (naming it).
        """
        if not self.done:
            shm = self._shm
            limit = (shm.timeout if timeout is None else timeout).total_seconds()
            try:
                state, ranks = shm.wait(self.seq, limit)
            except BaseException as exc:  # e.g. Ctrl-C mid-wait: the ranks are out of step
                shm.broken = f"an earlier exchange's wait was interrupted ({type(exc).__name__})"
                raise
            if state == 1:
                raise RuntimeError(
                    f"shared-memory barrier timed out after {limit:g}s on rank {shm.rank}: ranks "
                    f"{ranks} never arrived at this exchange"
                )
            if state == 2:
                shm.broken = f"an earlier exchange failed: ranks {ranks} exited"
                raise RuntimeError(
                    f"shared-memory barrier: ranks {ranks} exited (or closed their plane) before "
                    f"arriving at this exchange (their lock on the plane's control block is gone)"
                )
            at = shm.arrived_at(self.seq)  # read before a later exchange can reuse the slot
            try:
                self._finish()
            except BaseException as exc:  # the peers' files were not all mapped: no retry
                shm.broken = f"an earlier exchange failed: exchange {self.seq} ({exc})"
                raise
            # a peer's clock ahead of ours (another time namespace on this /dev/shm): unknown
            self.completed_at = at if at <= time.perf_counter() else None
            self.done, self._keep = True, ()
        return True

    def is_completed(self) -> bool:
        """Whether every rank has written (the rows are read by the next :meth:`wait`)."""
        return self.done or self._shm.wait(self.seq, 0.0)[0] == 0


class SharedMemory:
    """Shared-memory all-to-all for the ranks of one host (made by :func:`open_shared`).

    Args:
        rank: this rank in the plane's group; world: the group's size.
        token: the files' name part every rank agreed on.
        control: the control block's descriptor (holding this rank's lock) and mapping.
        timeout: the plane's collective timeout.
    """

    def __init__(
        self, rank: int, world: int, token: str, control: tuple[int, torch.Tensor],
        timeout: timedelta = timedelta(seconds=60),
    ) -> None:  # fmt: skip
        self.rank, self.world, self.token = rank, world, token
        self.timeout = timeout  # of every barrier wait (a ShmWork's unless it is given one)
        self._ctl_fd, self._ctl = control
        self._ctl_addr = self._ctl.data_ptr()
        # slot r's gen[k]: [r * 8 + 1 + k]; its arrival time at[k]: [r * 8 + 3 + k]
        self._ctl_gens = self._ctl.numpy().view(np.int64)
        self.head = header_bytes(world)  # a half's header: byte offsets
        self.cap = 0  # bytes in each half of this rank's file
        self.gen = 0  # this rank's file generation (0: none yet)
        self._mine: torch.Tensor | None = None
        self._mine_np: np.ndarray | None = None
        self._mine_p = 0  # its address
        self._mine_hdr: tuple[np.ndarray, ...] = ()  # each half's header, int64 offsets
        self._peers: dict[int, tuple] = {}  # rank -> (gen, cap, address, headers, map)
        self._calls = 0  # exchanges so far, the same on every rank: which half is in use
        # this rank's files still named on disk: (the exchange that published it, path),
        # unlinked once a later exchange's barrier passed (every peer has mapped them by then)
        self._named: list[tuple[int, str]] = []
        self._owned: list[str] = []  # every file of this rank still on disk (removed at exit)
        weakref.finalize(self, _remove, self._owned)
        self._lent: tuple[int, int] | None = None  # (exchange, address) of send_rows' rows
        # (exchange, spans per source rank) of land(): where the next exchange's rows go
        self._land: tuple[int, dict[int, np.ndarray]] | None = None
        self.broken: str | None = None  # why no exchange may run any more (a failed one)
        self.exchanges = 0  # all-to-alls run through shared memory
        self.in_place = 0  # of which took their rows where send_rows lent them (no copy in)
        self.landed = 0  # of which copied their received rows run by run where land() said

    def path(self, rank: int, gen: int) -> str:
        """The file of ``rank``'s generation ``gen``."""
        return os.path.join(SHM_DIR, f"conduit-{self.token}-{rank}-{gen}")

    def _grow(self, need: int) -> None:
        """A new file whose halves hold ``need`` bytes at least (twice the old at least).

        Raises:
            ConfigError: if ``/dev/shm`` cannot hold it (nothing is left of the new file).
        """
        cap = half_bytes(need, self.cap)
        path = self.path(self.rank, self.gen + 1)
        try:
            fd = create(path, 2 * cap)  # a full /dev/shm fails here, not in a write
        except OSError as exc:
            raise ConfigError(
                f"transport.shared_memory: rank {self.rank} could not reserve "
                f"{2 * cap / 2**20:.1f} MiB in {SHM_DIR} ({exc.strerror}); make {SHM_DIR} "
                "larger (docker: --shm-size) or set shared_memory=False"
            ) from exc
        self._owned.append(path)  # from here on removed at close or exit, whatever fails
        try:
            mapped, mapped_np = _map(fd, 2 * cap)
        finally:
            os.close(fd)
        self._named.append((self._calls + 1, path))  # published by the next exchange
        self._mine, self._mine_np, self.cap, self.gen = mapped, mapped_np, cap, self.gen + 1
        self._mine_p, self._mine_hdr = mapped.data_ptr(), self._headers(mapped_np, cap)

    def send_rows(self, rows: int, width: int) -> tuple[torch.Tensor, np.ndarray] | None:
        """``uint8 [rows, width]`` in the half the next :meth:`start` uses (torch and NumPy
        views), for a sender to write its rows into directly: passed to :meth:`start` as
        ``inp``, they are not copied again. Valid until that exchange is launched. ``None``
        where the file cannot grow: write elsewhere (``start`` then fails on every rank), and
        where there is nothing to write (``rows * width == 0``: an empty tensor's address is
        0, so nothing would tell :meth:`start` it was lent)."""
        if rows * width == 0:
            return None
        need = self.head + rows * width
        if need > self.cap:
            try:
                self._grow(need)
            except ConfigError:  # start() tries again, and fails naming this rank to every rank
                return None
        at = (self._calls % 2) * self.cap + self.head
        end = at + rows * width
        self._lent = (self._calls, self._mine.data_ptr() + at)  # start() takes it, or refuses
        return self._mine[at:end].view(rows, width), self._mine_np[at:end].reshape(rows, width)

    def unlend(self) -> None:
        """Forget rows :meth:`send_rows` lent that will not be this rank's next exchange's input
        (their writer failed): the next :meth:`start` copies its input as usual."""
        self._lent = None

    def land(self, spans: dict[int, np.ndarray]) -> None:
        """Have the next :meth:`start` copy each source's rows for this rank straight to where
        the caller wants them, in runs, instead of into ``out`` as one block per source (a
        scatter-receive: the receiver's reordering costs no copy of its own).

        Args:
            spans: per source rank (this rank included), int64 ``[k, 3]`` rows of (destination
                address, byte offset in that source's block for this rank, bytes). The
                destinations are the caller's and must stay alive and unread until the
                exchange's ``wait`` returned; every offset is checked against the block's size
                (the source's split) before anything is copied.
        """
        self._land = (self._calls, spans)

    def _landed(
        self, land: dict[int, np.ndarray], p: int, base: int, n: int, spans: list[int]
    ) -> None:
        """Append the copies of source ``p``'s ``n``-byte block at ``base`` that ``land`` asks
        for to ``spans``.

        Raises:
            RuntimeError: if one lies outside the block.
        """
        runs = land.get(p)
        if runs is None or not len(runs):
            return
        off, size = runs[:, 1], runs[:, 2]
        if int(off.min()) < 0 or int(size.min()) < 0 or int((off + size).max()) > n:
            raise RuntimeError(
                f"shared-memory all_to_all on rank {self.rank}: a landing run from rank {p} "
                f"lies outside its {n}-byte block (offsets {int(off.min())}.."
                f"{int((off + size).max())})"
            )
        runs = runs.copy()
        runs[:, 1] += base
        spans += runs.ravel().tolist()

    def _headers(self, mapped: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray]:
        """The two halves' headers of a file of ``cap``-byte halves (int64 offsets, one per
        destination rank)."""
        n = 8 * self.world
        return mapped[:n].view(np.int64), mapped[cap : cap + n].view(np.int64)

    def _peer(self, p: int, gen: int) -> tuple[int, int, tuple[np.ndarray, np.ndarray]]:
        """Peer ``p``'s file of generation ``gen``, mapped (kept until it changes): its halves'
        size, its address and its halves' headers."""
        got = self._peers.get(p)
        if got is None or got[0] != gen:
            try:  # never created here: the peer's own
                fd = os.open(self.path(p, gen), os.O_RDWR)
            except FileNotFoundError as exc:
                raise RuntimeError(
                    f"shared-memory all_to_all on rank {self.rank}: rank {p}'s file of "
                    f"generation {gen} was removed before this rank mapped it (rank {p} closed "
                    f"its plane or exited after arriving, or the file was removed from {SHM_DIR})"
                ) from exc
            try:
                size = os.fstat(fd).st_size
                seg, seg_np = _map(fd, size)
            finally:
                os.close(fd)
            cap = size // 2
            got = self._peers[p] = (gen, cap, seg.data_ptr(), self._headers(seg_np, cap), seg)
        return got[1], got[2], got[3]

    def start(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
    ) -> ShmWork:
        """Write this rank's rows for its peers (unless ``inp`` is :meth:`send_rows`'s) and its
        own, launch the barrier; the returned work's ``wait`` lands the peers' rows in ``out``
        (``all_to_all_single``'s contract, host tensors, splits in rows along dim 0; ``[]``:
        even)."""
        world, me = self.world, self.rank
        if self.broken is not None or self._ctl_fd < 0:
            raise RuntimeError(
                f"shared-memory all_to_all on rank {me}: "
                + (self.broken or "closed")
                + "; build a new plane"
            )
        if not (out.is_contiguous() and inp.is_contiguous() and out.is_cpu and inp.is_cpu):
            raise ValueError(
                "shared-memory all_to_all: expected contiguous host tensors, got out on "
                f"{out.device} (contiguous: {out.is_contiguous()}), inp on {inp.device} "
                f"(contiguous: {inp.is_contiguous()})"
            )
        if (in_splits and len(in_splits) != world) or (out_splits and len(out_splits) != world):
            raise ValueError(
                f"shared-memory all_to_all: expected {world} splits (one per rank) or none, got "
                f"{len(in_splits)} in and {len(out_splits)} out"
            )
        src, dst = inp.data_ptr(), out.data_ptr()  # every copy below checked against these
        rb_in, rb_out = _row_bytes(inp), _row_bytes(out)
        if not in_splits:
            in_splits = [inp.shape[0] // world] * world
        if not out_splits:
            out_splits = [out.shape[0] // world] * world
        i_off = [k * rb_in for k in _offsets(in_splits)]
        o_off = [k * rb_out for k in _offsets(out_splits)]
        n_in, n_out = inp.numel() * inp.element_size(), out.numel() * out.element_size()
        n_own = out_splits[me] * rb_out
        if (
            i_off[-1] > n_in or o_off[-1] > n_out or min(in_splits) < 0 or min(out_splits) < 0
            or n_own != in_splits[me] * rb_in
        ):  # fmt: skip
            raise ValueError(
                f"shared-memory all_to_all on rank {me}: splits {in_splits} of {rb_in}-byte rows "
                f"in and {out_splits} of {rb_out}-byte rows out, expected non-negative, within "
                f"inp's {n_in} and out's {n_out} bytes, and as many bytes to itself as from itself"
            )
        half = self._calls % 2
        base = half * self.cap
        lent, self._lent = self._lent, None
        in_place = lent is not None and lent == (self._calls, src)
        landing, self._land = self._land, None
        if landing is not None and landing[0] != self._calls:
            raise RuntimeError(
                "shared-memory all_to_all: land() was called for another exchange (one ran in "
                "between)"
            )
        land = None if landing is None else landing[1]
        spans: list[int] = []  # (to, from, bytes) of each copy
        if lent is not None and not in_place:  # the lent rows would be overwritten here
            raise RuntimeError(
                "shared-memory all_to_all: rows from send_rows() were not the next exchange's "
                "input (another exchange ran in between)"
            )
        if in_place:  # written into send_rows: each block is where it was written
            offsets = [self.head + i_off[d] for d in range(world)]
        else:
            sizes = [-(-(n * rb_in) // _ALIGN) * _ALIGN for n in in_splits]
            need = self.head + sum(s for d, s in enumerate(sizes) if d != me)
            if need > self.cap:
                try:
                    self._grow(need)
                except ConfigError:
                    self._announce_failure()
                    raise
                base = half * self.cap
            mine, at, offsets = self._mine_p + base, self.head, [0] * world
            for d in range(world):
                n = in_splits[d] * rb_in
                if d != me and n:  # within the half: need <= cap above
                    spans += (mine + at, src + i_off[d], n)
                    offsets[d] = at
                    at += sizes[d]
        self._mine_hdr[half][:] = offsets
        if n_own and land is not None:
            self._landed(land, me, src + i_off[me], n_own, spans)
        elif n_own:
            spans += (dst + o_off[me], src + i_off[me], n_own)
        if spans:  # one native call for every copy (torch's slice and copy_: ~4 us each)
            _native.copy_spans(tuple(spans))
        self._calls += 1
        seq = self._calls
        _native.shm_arrive(self._ctl_addr, me, seq, self.gen)
        self.exchanges += 1
        self.in_place += bool(in_place)
        self.landed += land is not None

        def finish() -> None:
            gens = self._ctl_gens[1 + (seq & 1) :: _SLOT // 8][:world].tolist()
            failed = [p for p, g in enumerate(gens) if g < 0]
            if failed:
                raise ConfigError(
                    f"transport.shared_memory: ranks {failed} could not make room for this "
                    f"exchange in {SHM_DIR} (their own errors say how much; is it full?)"
                )
            spans: list[int] = []
            for p in range(world):
                n = out_splits[p] * rb_out
                if p == me or not gens[p]:
                    continue
                cap, addr, heads = self._peer(p, int(gens[p]))  # a new file: mapped now
                if not n:
                    continue
                off = int(heads[half][me])
                if off < self.head or off + n > cap:  # the peer disagrees on the splits
                    raise RuntimeError(
                        f"shared-memory all_to_all on rank {me}: rank {p}'s {n} bytes for it "
                        f"at offset {off} lie outside its {cap}-byte half"
                    )
                if land is not None:
                    self._landed(land, p, addr + half * cap + off, n, spans)
                else:
                    spans += (dst + o_off[p], addr + half * cap + off, n)
            if spans:
                _native.copy_spans(tuple(spans))
            while self._named and self._named[0][0] < seq:  # every peer has mapped it
                path = self._named.pop(0)[1]
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                self._owned.remove(path)

        return ShmWork(self, seq, finish, (out, inp))

    def arrived_at(self, seq: int) -> float:
        """When the last rank arrived at exchange ``seq`` (every rank has: ``wait`` returned 0),
        in ``time.perf_counter`` seconds (both read CLOCK_MONOTONIC, one clock on one host)."""
        ns = self._ctl_gens[3 + (seq & 1) :: _SLOT // 8][: self.world]
        return int(ns.max()) * 1e-9

    def wait(self, seq: int, timeout_s: float) -> tuple[int, list[int]]:
        """Wait until every rank arrived at exchange ``seq`` (``0``, ``[]``), or say which ranks
        had not at ``timeout_s`` (``1``, ranks; ``0.0``: check once) or exited (``2``, ranks).

        Raises:
            RuntimeError: after :meth:`close`.
        """
        if self._ctl_fd < 0:
            raise RuntimeError(f"shared memory of rank {self.rank}: waited on after close()")
        return _native.shm_wait(self._ctl_addr, self.world, self.rank, seq, timeout_s, self._ctl_fd)

    def _announce_failure(self) -> None:
        """Arrive at this exchange's barrier with generation -1, so that every peer fails it
        naming this rank, instead of waiting for the timeout (this rank raises its own error at
        once: it has nothing to wait for)."""
        self._calls += 1
        _native.shm_arrive(self._ctl_addr, self.rank, self._calls, -1)
        self.broken = "an earlier exchange failed: this rank could not grow its file"

    def close(self) -> None:
        """Remove this rank's files (the mappings peers hold stay valid until they drop them);
        also run at interpreter exit for a plane never closed."""
        _remove(self._owned)
        self._named, self._mine, self._mine_np, self._peers = [], None, None, {}
        self._mine_p, self._mine_hdr = 0, ()  # the mapping goes with its last view
        if self._ctl_fd >= 0:  # releases this rank's lock: peers see it gone
            os.close(self._ctl_fd)
            self._ctl_fd = -1
        self.gen = self.cap = 0
        self._lent = self._land = None


def create(path: str, size: int) -> int:
    """Create ``path`` (never an existing file) with ``size`` bytes reserved; returns its open
    descriptor.

    Raises:
        OSError: where it cannot be made or ``/dev/shm`` cannot hold it (nothing is left).
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    return fd


def _map(fd: int, size: int) -> tuple[torch.Tensor, np.ndarray]:
    """``size`` bytes of the open file ``fd`` mapped shared, as torch and NumPy views (the
    mapping lives as long as they do)."""
    mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    arr = np.frombuffer(mm, dtype=np.uint8)
    return torch.from_numpy(arr), arr


def _remove(paths: list[str]) -> None:
    """Unlink ``paths`` (those already gone are skipped) and empty the list."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    paths.clear()
