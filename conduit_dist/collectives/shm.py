"""All-to-all of host rows between the ranks of one host through shared memory
(``TransportConfig(shared_memory=True)``).

gloo moves host tensors between processes over TCP, on one host too: every byte crosses the
loopback socket, copied by the kernel on each side. Here each rank owns one file in ``/dev/shm``
(mapped by every rank of the group), split in two halves used by alternate exchanges. An
exchange writes this rank's rows for each peer into its half after a small header of byte
offsets (one per destination), launches a tiny gloo all-reduce (the barrier, which also carries
each rank's file generation), and, once every rank has written, copies each peer's rows for
this rank out of that peer's half. The own rows are copied directly. Nothing is pickled.

Why two halves are enough: a rank writes a half again two exchanges later, after the barrier of
the exchange in between, which every peer enters only once it has finished reading the exchange
before it. A half too small makes a new, larger file (the next generation, twice the size at
least); the old one is unlinked after the next barrier: a peer opens it by name only while
reading the exchange before that barrier, and its mapping outlives the name. A peer's file is
opened without ``O_CREAT`` (never recreated by a reader). Files are named
``conduit-<token>-<rank>-<generation>`` (the token agreed at start-up) and removed at
:meth:`SharedMemory.close` (a plane's ``close`` runs a barrier first, so no peer still reads) or
at interpreter exit; a process killed by a signal leaves its files behind
(``rm /dev/shm/conduit-*``). Space is reserved with ``posix_fallocate`` before any byte is
written, so a full ``/dev/shm`` fails with a clear error, never with a ``SIGBUS``: the rank
that hit it still enters the exchange's barrier with generation -1, and every peer fails the
exchange naming it.

Which exchanges use it: every all-to-all of host tensors (the header exchange, writing its send
rows in place; ingestion and delivery where the ``all_to_all`` strategy runs them). The meta
all-gather, the ``p2p``, ``chunked4`` and ``gather`` strategies, broadcasts and rows on the GPU
still go through the group.
Files only grow: each rank's holds two halves of at least its largest exchange so far
(calibration probes included).

Every rank must call :meth:`SharedMemory.start` for the same exchanges in the same order (as for
any collective); waiting (:class:`ShmWork`) has the plane's timeout through the barrier's gloo
work.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import secrets
import weakref
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from conduit_dist.errors import ConfigError

SHM_DIR = "/dev/shm"
_ALIGN = 64  # each block starts on a cache line


def _offsets(splits: list[int]) -> list[int]:
    return [0, *itertools.accumulate(splits)]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes, flat (``t`` contiguous, as ``all_to_all_single`` requires)."""
    return t.reshape(-1).view(torch.uint8)


def _row_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size() // t.shape[0] if t.dim() and t.shape[0] else 0


class ShmWork:
    """The barrier's gloo work of one exchange; the first successful :meth:`wait` copies this
    rank's rows out of the peers' halves (``wait`` returns as gloo's does, and may be called
    again after gloo's timeout raised)."""

    def __init__(self, work: dist.Work, finish) -> None:
        self.work, self._finish, self.done = work, finish, False

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for every rank to have written, then read what the peers wrote for this rank."""
        ok = self.work.wait() if timeout is None else self.work.wait(timeout)
        if ok is False:
            return False
        if not self.done:
            self._finish()
            self.done = True
        return True

    def is_completed(self) -> bool:
        """Whether every rank has written (the rows are read by the next :meth:`wait`)."""
        return self.done or self.work.is_completed()


class SharedMemory:
    """Shared-memory all-to-all for the ranks of ``group`` (all on one host: :func:`agree`).

    Args:
        group: the plane's process group (its gloo backend runs the barrier).
        rank: this rank in the group; world: the group's size.
        token: the files' name part every rank agreed on.
        timeout: the plane's collective timeout.
    """

    def __init__(
        self, group: dist.ProcessGroup, rank: int, world: int, token: str,
        timeout: timedelta = timedelta(seconds=60),
    ) -> None:  # fmt: skip
        self.group, self.rank, self.world, self.token = group, rank, world, token
        self.timeout = timeout  # of the barrier a rank that cannot grow its file still enters
        self.head = -(-world * 8 // _ALIGN) * _ALIGN  # a half's header: byte offsets
        self.cap = 0  # bytes in each half of this rank's file
        self.gen = 0  # this rank's file generation (0: none yet)
        self._mine: torch.Tensor | None = None
        self._mine_np: np.ndarray | None = None
        self._peers: dict[int, tuple] = {}  # rank -> (gen, cap, map, its numpy view)
        self._calls = 0  # exchanges so far, the same on every rank: which half is in use
        self._stale: list[str] = []  # old files of this rank, unlinked after the next barrier
        self._owned: list[str] = []  # every file of this rank still on disk (removed at exit)
        weakref.finalize(self, _remove, self._owned)
        self._gens = torch.zeros(world, dtype=torch.int64)
        self._gens_np = self._gens.numpy()  # (a Python int set into a tensor makes a tensor)
        self._lent: tuple[int, int] | None = None  # (exchange, address) of send_rows' rows
        self.exchanges = 0  # all-to-alls run through shared memory
        self.in_place = 0  # of which took their rows where send_rows lent them (no copy in)
        self._opts = dist.AllreduceOptions()

    def path(self, rank: int, gen: int) -> str:
        """The file of ``rank``'s generation ``gen``."""
        return os.path.join(SHM_DIR, f"conduit-{self.token}-{rank}-{gen}")

    def _grow(self, need: int) -> None:
        """A new file whose halves hold ``need`` bytes at least (twice the old at least).

        Raises:
            ConfigError: if ``/dev/shm`` cannot hold it (nothing is left of the new file).
        """
        cap = -(-max(need, 2 * self.cap, 1 << 16) // _ALIGN) * _ALIGN
        path = self.path(self.rank, self.gen + 1)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._owned.append(path)  # from here on removed at close or exit, whatever fails
        try:
            try:
                os.posix_fallocate(fd, 0, 2 * cap)  # a full /dev/shm fails here, not in a write
            except OSError as exc:
                self._owned.remove(path)
                os.unlink(path)
                raise ConfigError(
                    f"transport.shared_memory: rank {self.rank} could not reserve "
                    f"{2 * cap / 2**20:.1f} MiB in {SHM_DIR} ({exc.strerror}); make {SHM_DIR} "
                    "larger (docker: --shm-size) or set shared_memory=False"
                ) from exc
            mapped, mapped_np = _map(fd, 2 * cap)
        finally:
            os.close(fd)
        if self.gen:
            self._stale.append(self.path(self.rank, self.gen))
        self._mine, self._mine_np, self.cap, self.gen = mapped, mapped_np, cap, self.gen + 1

    def send_rows(self, rows: int, width: int) -> tuple[torch.Tensor, np.ndarray] | None:
        """``uint8 [rows, width]`` in the half the next :meth:`start` uses (torch and NumPy
        views), for a sender to write its rows into directly: passed to :meth:`start` as
        ``inp``, they are not copied again. Valid until that exchange is launched. ``None``
        where the file cannot grow: write elsewhere (``start`` then fails on every rank)."""
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

    def _peer(self, p: int, gen: int) -> tuple[int, torch.Tensor, np.ndarray]:
        """Peer ``p``'s file of generation ``gen``, mapped (kept until it changes)."""
        got = self._peers.get(p)
        if got is None or got[0] != gen:
            fd = os.open(self.path(p, gen), os.O_RDWR)  # never created here: the peer's own
            try:
                size = os.fstat(fd).st_size
                seg, seg_np = _map(fd, size)
            finally:
                os.close(fd)
            got = self._peers[p] = (gen, size // 2, seg, seg_np)
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
        if not (out.is_contiguous() and inp.is_contiguous()):
            raise ValueError("shared-memory all_to_all: expected contiguous out and inp tensors")
        src, dst = _bytes(inp), _bytes(out)
        rb_in, rb_out = _row_bytes(inp), _row_bytes(out)
        if not in_splits:
            in_splits = [inp.shape[0] // world] * world
        if not out_splits:
            out_splits = [out.shape[0] // world] * world
        i_off = [k * rb_in for k in _offsets(in_splits)]
        o_off = [k * rb_out for k in _offsets(out_splits)]
        half = self._calls % 2
        base = half * self.cap
        lent, self._lent = self._lent, None
        in_place = lent is not None and lent == (self._calls, src.data_ptr())
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
            mine, at, offsets = self._mine, self.head, [0] * world
            for d in range(world):
                n = in_splits[d] * rb_in
                if d != me and n:
                    mine[base + at : base + at + n].copy_(src[i_off[d] : i_off[d] + n])
                    offsets[d] = at
                    at += sizes[d]
        self._mine_np[base : base + 8 * world].view(np.int64)[:] = offsets
        n_own = out_splits[me] * rb_out
        if n_own:
            dst[o_off[me] : o_off[me] + n_own].copy_(src[i_off[me] : i_off[me] + n_own])
        self._gens_np[:] = 0
        self._gens_np[me] = self.gen
        work = self.group.allreduce([self._gens], self._opts)
        self._calls += 1
        self.exchanges += 1
        self.in_place += bool(in_place)

        def finish() -> None:
            gens = self._gens_np.tolist()
            failed = [p for p, g in enumerate(gens) if g < 0]
            if failed:
                raise ConfigError(
                    f"transport.shared_memory: ranks {failed} could not make room for this "
                    f"exchange in {SHM_DIR} (their own errors say how much; is it full?)"
                )
            for p in range(world):
                n = out_splits[p] * rb_out
                if p == me or not n:
                    continue
                cap, seg, seg_np = self._peer(p, int(gens[p]))
                pbase = half * cap
                off = int(seg_np[pbase + 8 * me : pbase + 8 * me + 8].view(np.int64)[0])
                dst[o_off[p] : o_off[p] + n].copy_(seg[pbase + off : pbase + off + n])
            for path in self._stale:  # no peer opens these by name any more (see the module)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                self._owned.remove(path)
            self._stale = []

        return ShmWork(work, finish)

    def _announce_failure(self) -> None:
        """Enter this exchange's barrier with generation -1, so that every peer fails it naming
        this rank, instead of waiting for the timeout."""
        self._gens_np[:] = 0
        self._gens_np[self.rank] = -1
        work = self.group.allreduce([self._gens], self._opts)
        with contextlib.suppress(Exception):  # the error to raise is the caller's
            work.wait(self.timeout)

    def close(self) -> None:
        """Remove this rank's files (the mappings peers hold stay valid until they drop them);
        also run at interpreter exit for a plane never closed."""
        _remove(self._owned)
        self._stale, self._mine, self._mine_np, self._peers = [], None, None, {}
        self.gen = self.cap = 0
        self._lent = None


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


def open_shared(ex, wanted: bool) -> SharedMemory | None:
    """Whether every rank of ``ex``'s group asked for shared memory (``wanted``), and if so,
    check that each sees rank 0's ``/dev/shm`` and return its :class:`SharedMemory` (``None``:
    nobody asked). Collective: every rank calls it at the same point, whatever it wants.

    Raises:
        ConfigError: naming the ranks that asked where others did not, or that do not see rank
            0's ``/dev/shm`` (another host, or another container).
    """
    asked = torch.zeros(ex.world, dtype=torch.int64)
    asked[ex.rank] = int(wanted)
    ex.run(lambda: dist.all_reduce(asked, group=ex.group, async_op=True), "shm setting")
    yes = [r for r, a in enumerate(asked.tolist()) if a]
    if not yes:
        return None
    if len(yes) < ex.world:
        raise ConfigError(
            f"transport.shared_memory: ranks {yes} set it, ranks "
            f"{sorted(set(range(ex.world)) - set(yes))} did not; expected the same on every rank"
        )
    token = torch.zeros(2, dtype=torch.int64)  # [token, whether rank 0 wrote its probe]
    why = ""
    if ex.rank == 0:
        token[0] = secrets.randbits(62)
        try:
            with open(os.path.join(SHM_DIR, f"conduit-{int(token[0]):016x}-probe"), "wb"):
                pass
            token[1] = 1
        except OSError as exc:
            why = f" ({exc.strerror})"
    ex.run(lambda: dist.broadcast(token, 0, group=ex.group, async_op=True), "shm token")
    if not int(token[1]):
        raise ConfigError(
            f"transport.shared_memory: rank 0 could not create a file in {SHM_DIR}{why}; set "
            "shared_memory=False where there is no shared /dev/shm"
        )
    name = f"{int(token[0]):016x}"
    probe = os.path.join(SHM_DIR, f"conduit-{name}-probe")
    seen = torch.zeros(ex.world, dtype=torch.int64)
    seen[ex.rank] = int(os.path.exists(probe))
    ex.run(lambda: dist.all_reduce(seen, group=ex.group, async_op=True), "shm probe")
    if ex.rank == 0:
        os.unlink(probe)
    missing = [r for r, s in enumerate(seen.tolist()) if not s]
    if missing:
        raise ConfigError(
            f"transport.shared_memory: ranks {missing} do not see rank 0's {SHM_DIR} (another "
            "host, or a container with its own); set shared_memory=False for planes across hosts"
        )
    return SharedMemory(ex.group, ex.rank, ex.world, name, ex.timeout)
