"""Writing one rank's part of a checkpoint on a background thread (see ``files.py``).

The caller takes the snapshot between rounds (``save.py``); the thread writes the small state
first, then the items oldest first through the copy-on-write snapshot (as fast as the disk
takes them unless ``write_mbps``), checksums them (at most ``checksum_mbps`` if set), and writes
its ``done`` file last. Rank 0 then waits for every rank's
``done`` file, writes the manifest and renames the directory: the checkpoint is complete. No
collective runs on the thread (file presence is the only coordination), so rounds may use the
group meanwhile; ``root`` must be one file system every rank sees (as
``torch.distributed.checkpoint``'s file system writer assumes).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import mmap
import os
import threading
import time
import zlib

import torch

from conduit_dist.checkpoint import files
from conduit_dist.checkpoint.snapshot import ShardSnapshot
from conduit_dist.errors import CheckpointError
from conduit_dist.threads import start_thread

CHUNK_BYTES = 8 << 20  # bytes read and written at a time
_ALIGN = 4096  # O_DIRECT: buffer address, length and file offset


class Checkpoint:
    """One rank's checkpoint in flight; :meth:`wait` for its part (rank 0: the whole).

    Attributes:
        path: the complete directory it becomes (``ROOT/ckpt-R``).
        round: the round boundary it holds.
        items: this rank's items in it.
    """

    def __init__(
        self, root: str, round: int, token: int, rank: int, world: int, items: int
    ) -> None:
        self.root, self.round, self.rank, self.world, self.items = root, round, rank, world, items
        self.path = files.directory(root, round)
        self.tmp = files.directory(root, round, token)
        self.error: BaseException | None = None
        self.write_s = 0.0  # time the thread took (its own part)
        self.copied_bytes = 0  # copy-on-write copies the rounds made meanwhile
        self.direct_io: bool | None = None  # items written with O_DIRECT (None: not yet)
        self._thread: threading.Thread | None = None

    @property
    def done(self) -> bool:
        """Whether this rank's part is written (or failed)."""
        return self._thread is None or not self._thread.is_alive()

    @property
    def complete(self) -> bool:
        """Whether the whole checkpoint (every rank, manifest) is on disk."""
        return os.path.isdir(self.path)

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until this rank's part is written (rank 0: until the checkpoint is complete).

        Raises:
            CheckpointError: if writing failed, or it is not done within ``timeout_s``.
        """
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise CheckpointError(
                    f"checkpoint {self.tmp}: rank {self.rank}'s part not written within "
                    f"{timeout_s} s"
                )
        if self.error is not None:
            raise CheckpointError(
                f"checkpoint {self.tmp}: rank {self.rank} failed to write it: {self.error}"
            ) from self.error

    def start(
        self,
        meta: dict,
        snap: ShardSnapshot,
        rates: tuple[float, float],
        keep: int,
        timeout_s: float,
    ) -> None:
        """Write on a daemon thread (errors are kept for :meth:`wait`), whose current CUDA
        device is the snapshot's tiers' (``threads.start_thread``; none for host tiers)."""

        def run() -> None:
            t0 = time.perf_counter()
            try:
                done = self._write_part(meta, snap, rates)
                if self.rank == 0:
                    self._finish(done, keep, timeout_s)
            except BaseException as e:  # surfaced at wait() / the plane's next call
                self.error = e
            finally:
                self.copied_bytes = snap.copied_bytes
                snap.close()
                self.write_s = time.perf_counter() - t0

        try:  # here: a root that cannot be written raises now
            os.makedirs(self.tmp, exist_ok=True)
        except OSError:
            snap.close()
            raise
        self._thread = start_thread(run, "conduit-checkpoint", snap.device)

    def _write_part(self, meta: dict, snap: ShardSnapshot, rates: tuple[float, float]) -> dict:
        j = self.rank
        meta_name, items_name = f"shard{j}.pt", f"shard{j}.items"
        meta_path = os.path.join(self.tmp, meta_name)
        torch.save(meta, meta_path + ".part")
        _fsync_rename(meta_path + ".part", meta_path)
        rb = snap.tiers[0].record_bytes
        items_path = os.path.join(self.tmp, items_name)
        crc, n_bytes, self.direct_io = _write_items(items_path + ".part", snap, rb, *rates)
        os.replace(items_path + ".part", items_path)
        done = {
            "rank": j,
            "round": self.round,
            "count": snap.count,
            "oldest": snap.oldest,
            "items": {"file": items_name, "bytes": n_bytes, "crc32": crc},
            "meta": dict(zip(("bytes", "crc32"), files.crc_file(meta_path)), file=meta_name),
        }
        files.write_json(os.path.join(self.tmp, f"shard{j}.done.json"), done)
        return done

    def _finish(self, mine: dict, keep: int, timeout_s: float) -> None:
        """Rank 0: wait for every rank's part, write the manifest, rename, prune."""
        deadline = time.monotonic() + timeout_s
        shards: list[dict | None] = [None] * self.world
        shards[0] = mine
        while any(s is None for s in shards):
            for j, s in enumerate(shards):
                path = os.path.join(self.tmp, f"shard{j}.done.json")
                if s is None and os.path.exists(path):
                    with open(path) as f:
                        shards[j] = json.load(f)
            if any(s is None for s in shards):
                if time.monotonic() > deadline:
                    missing = [j for j, s in enumerate(shards) if s is None]
                    raise CheckpointError(
                        f"ranks {missing} did not finish their part of round {self.round}'s "
                        f"checkpoint within {timeout_s} s"
                    )
                time.sleep(0.05)
        files.write_json(
            os.path.join(self.tmp, "manifest.json"),
            {
                "format": files.FORMAT,
                "round": self.round,
                "world": self.world,
                "items": sum(s["count"] for s in shards),
                "created": time.time(),
                "shards": shards,
            },
        )
        os.replace(self.tmp, self.path)
        _fsync_dir(self.root)
        files.prune(self.root, keep, self.tmp)


def _fsync_rename(src: str, dst: str) -> None:
    fd = os.open(src, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(src, dst)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_items(
    path: str, snap: ShardSnapshot, rb: int, write_mbps: float, checksum_mbps: float
) -> tuple[int, int, bool]:
    """Write the snapshot's records to ``path`` (at most ``write_mbps`` MB/s, 0: no limit),
    then checksum the file at most ``checksum_mbps`` MB/s; returns ``(crc32, bytes, direct)``.

    By default the records go out as fast as the disk takes them: the writer reads oldest
    first, the order the rounds overwrite in, so staying ahead of them means few copy-on-write
    copies (held back to 32 MB/s, the rounds overtook it and copied the whole 1 GiB shard,
    measured). Written with ``O_DIRECT`` from a page-aligned buffer where the file system
    allows it: the page cache's copy and writeback cost ~1-2.6 s of CPU per GiB here against
    0.15 s (measured, 1 GiB, fsync), CPU the rounds need; elsewhere (e.g. tmpfs) buffered
    (``direct`` says which).
    The CRC-32 (0.5 s of CPU per GiB) is then taken of the file as written, reading it back,
    at the rate limit.
    """
    per = max(1, CHUNK_BYTES // rb)
    mm = mmap.mmap(-1, per * rb + 2 * _ALIGN)  # page-aligned
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    direct_flag = getattr(os, "O_DIRECT", 0)
    try:
        fd, direct = os.open(path, flags | direct_flag), bool(direct_flag)
    except OSError:
        fd, direct = os.open(path, flags), False
    try:
        return _fill(fd, mm, buf, snap, rb, per, direct, write_mbps, checksum_mbps, path)
    finally:
        del buf
        with contextlib.suppress(BufferError):  # a traceback still holds a view: left to GC
            mm.close()


def _fill(fd, mm, buf, snap, rb, per, direct, write_mbps, checksum_mbps, path):
    """:func:`_write_items`' body (which closes the buffer however this ends)."""
    n_bytes, carry, t0 = 0, 0, time.perf_counter()
    try:
        while snap.read_upto < snap.count:
            k = min(per, snap.count - snap.read_upto)
            snap.read(k, buf[carry : carry + k * rb].view(k, rb))
            n_bytes += k * rb
            filled = carry + k * rb
            whole = filled - filled % _ALIGN if direct else filled
            direct = _write(fd, mm, whole, direct)
            carry = filled - whole
            if carry:  # the tail that is not a whole block waits for the next chunk
                buf[:carry].copy_(buf[whole:filled].clone())
            _keep_rate(n_bytes, write_mbps, t0)
        snap.close()  # every item is out: the rounds need not copy anything any more
        if carry:  # pad the last block, then cut the file to its length
            buf[carry:_ALIGN].zero_()
            _write(fd, mm, _ALIGN if direct else carry, direct)
            os.ftruncate(fd, n_bytes)
        os.fsync(fd)
    finally:
        os.close(fd)
    return _checksum(path, mm, direct, checksum_mbps), n_bytes, direct


def _checksum(path: str, mm: mmap.mmap, direct: bool, mbps: float) -> int:
    """CRC-32 of a file, read into ``mm`` at most ``mbps`` MB/s (0: no limit)."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
    chunk = len(mm) - len(mm) % _ALIGN
    crc, done, t0 = 0, 0, time.perf_counter()
    fd = os.open(path, flags)
    try:
        view = memoryview(mm)
        while (got := os.readv(fd, [view[:chunk]])) > 0:
            crc = zlib.crc32(view[:got], crc)
            done += got
            _keep_rate(done, mbps, t0)
        view.release()
    finally:
        os.close(fd)
    return crc


def _keep_rate(done: int, mbps: float, t0: float) -> None:
    """Sleep while ``done`` bytes since ``t0`` are ahead of ``mbps`` MB/s (0: no limit)."""
    if mbps:
        ahead = done / (mbps * 1e6) - (time.perf_counter() - t0)
        if ahead > 0:  # the rounds' CPU comes first
            time.sleep(ahead)


def _write(fd: int, mm: mmap.mmap, n: int, direct: bool) -> bool:
    """Write ``mm[:n]`` fully; returns whether ``O_DIRECT`` is still in use."""
    view = memoryview(mm)[:n]
    done = 0
    while done < n:
        try:
            done += os.write(fd, view[done:])
        except OSError as e:
            if not direct or e.errno != errno.EINVAL:
                raise
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            direct = False  # refused by this file system: buffered from here on
    view.release()
    return direct
