"""The storage protocols: :class:`Storage` (one rank's shard, what rounds, samplers and
checkpoints may ask of it) and :class:`Tier` (a fixed number of record slots in one kind of
memory).

A shard stores records in FIFO order; the ``g``-th item ever written on it has *generation*
``g``, and the live items are the generations ``oldest .. written - 1``. Everything outside the
shard addresses items by generation (samplers draw generations, delivered rows carry them,
checkpoints record them), so no caller knows where an item sits: a ring slot (``Shard``) or a
slot in one of several tiers (``TieredShard``).

Every tier keeps its slots as one ``uint8 [slots, record_bytes]`` tensor, ``self.data``, set by
the subclass (device memory, pinned or pageable host memory, a memory-mapped file); reads and
writes are tensor ops on it, so they are written once, here.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

import numpy as np
import torch

from conduit_dist.errors import ConfigError
from conduit_dist.records.spec import _native
from conduit_dist.tiers.cuda import IndexUpload, upload


class Tier:
    """Fixed-size record slots (``uint8 [slots, record_bytes]``) in one kind of memory.

    Args:
        slots: number of records the tier holds.
        record_bytes: bytes per record.
    """

    kind: str = "abstract"
    data: torch.Tensor

    def __init__(self, slots: int, record_bytes: int) -> None:
        self.slots = slots
        self.record_bytes = record_bytes
        self.read_gbps: float | None = None  # from calibrate() or declared
        self.write_gbps: float | None = None
        self.bandwidth_source = "none"
        # set while a checkpoint writes this tier in the background (checkpoint/snapshot.py):
        # called with ``(start, end)`` before slots ``[start, end)`` may be overwritten
        self.guard = None
        self._host_rows: torch.Tensor | None = None  # scratch for gathers into strided host out
        self._uploads: IndexUpload | None = None  # CUDA tiers: host-built indices, reused buffer

    def declare(self, read_gbps: float, write_gbps: float) -> None:
        """Take read/write bandwidths from config instead of measuring them.

        Raises:
            ConfigError: on a non-positive bandwidth.
        """
        if not (read_gbps > 0 and write_gbps > 0):
            raise ConfigError(
                f"tier_gbps[{self.kind!r}]: expected (read, write) GB/s > 0, "
                f"got ({read_gbps}, {write_gbps})"
            )
        self.read_gbps, self.write_gbps = float(read_gbps), float(write_gbps)
        self.bandwidth_source = "config"

    def calibrate(self, max_bytes: int = 16 << 20, repeats: int = 3) -> None:
        """Measure write (contiguous rows) and read (random-row gather) bandwidth on this tier.

        Runs on an empty tier, at start-up: up to ``max_bytes`` of its first slots are written,
        gathered back (the best of ``repeats`` each), then zeroed again. A disk tier is measured
        through the page cache, as rounds use it.
        """
        rows = max(1, min(self.slots, max_bytes // self.record_bytes))
        src = torch.randint(0, 256, (rows, self.record_bytes), dtype=torch.uint8)
        src = src.to(self.data.device)
        out = torch.empty_like(src)
        idx = torch.randint(0, rows, (rows,), dtype=torch.int64)
        # CUDA only: the copies are timed to their end on the current stream (not the device)
        stream = torch.cuda.current_stream(self.data.device) if self.data.is_cuda else None
        best_w = best_r = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.write(0, src)
            if stream is not None:
                stream.synchronize()
            t1 = time.perf_counter()
            self.gather(idx, out)
            if stream is not None:
                stream.synchronize()
            t2 = time.perf_counter()
            best_w, best_r = min(best_w, t1 - t0), min(best_r, t2 - t1)
        self.region(0, rows).zero_()
        nbytes = rows * self.record_bytes
        self.write_gbps = nbytes / max(best_w, 1e-9) / 1e9
        self.read_gbps = nbytes / max(best_r, 1e-9) / 1e9
        self.bandwidth_source = "calibrated"

    @property
    def capacity_bytes(self) -> int:
        """Bytes this tier holds at most."""
        return self.slots * self.record_bytes

    def region(self, start: int, end: int) -> torch.Tensor:
        """A writable, contiguous view of slots ``[start, end)`` (received into directly).

        Every write into the tier goes through here, so a running checkpoint's ``guard`` first
        keeps what those slots held (copy-on-write). On a CUDA tier the guard's copy is issued
        on the caller's current stream, so the write that follows on that stream comes after it
        (the checkpoint writer waits on an event the guard records: ``checkpoint/snapshot.py``).
        """
        guard = self.guard  # read once: a finishing checkpoint clears it from its thread
        if guard is not None:
            guard(start, end)
        return self.data[start:end]

    def gather(self, slots: torch.Tensor, out: torch.Tensor, base: int = -1) -> None:
        """Copy the records at ``slots`` into ``out``, which may be on another device or strided.

        In host memory (and memory-mapped files) a native loop copies whole rows, prefetching a
        few rows ahead: random rows of a large store miss the caches, and overlapping the misses
        made a 256-row gather of 536-byte records ~2x faster than ``index_select`` here. Elsewhere
        rows are moved as int64 words (records are 8-byte multiples): ``index_select`` copies
        element by element, and 8x fewer elements made it ~4x faster for small records.

        Rows are gathered where the tier is, straight into ``out`` when it is contiguous and on
        the tier's device, else into scratch rows there, then copied into ``out`` once. Into host
        memory that copy is synchronous (a CUDA tier waits for the current stream only): the
        caller may read ``out`` on the host when this returns. Into CUDA memory it is ordered on
        the current stream, and host-built indices go up without a host sync (``tiers/cuda.py``).

        Args:
            slots: int64 slots (or, with ``base >= 0``, generations), on the host or the tier's
                device.
            out: ``uint8 [len(slots), record_bytes]`` on any device, any strides.
            base: ``>= 0``: ``slots`` are generations of a ring over this tier whose oldest live
                one is in the lap starting at generation ``base`` (slot ``g % self.slots``,
                computed without a division per row in host memory).

        Raises:
            ValueError: if ``out`` is not ``uint8 [len(slots), record_bytes]``.
            IndexError: on a slot outside the tier (slots on the host; checked before any copy).
        """
        n = slots.shape[0]  # len() of a tensor is a Python-level call: ~1.5 us
        if out.dtype is not torch.uint8 or out.dim() != 2 or out.shape != (n, self.record_bytes):
            raise ValueError(
                f"{self.kind} tier gather: expected out uint8 [{n}, {self.record_bytes}], "
                f"got {out.dtype} {list(out.shape)}"
            )
        here = out.is_cpu if self.data.is_cpu else out.device == self.data.device
        if here and out.is_contiguous():
            self._gather_here(slots, out, base)
            return
        rows = self._scratch(n, pinned=out.is_cuda and self.data.is_cpu)
        self._gather_here(slots, rows, base)
        # into host memory: synchronous (see above); into CUDA memory: on the current stream
        out.copy_(rows, non_blocking=out.is_cuda)

    def _gather_here(self, slots: torch.Tensor, rows: torch.Tensor, base: int) -> None:
        """:meth:`gather` into contiguous ``rows`` on the tier's device."""
        data = self.data
        if data.is_cpu:
            idx = slots if slots.is_cpu else slots.cpu()  # host slots: the contract's case
            if _native is not None and idx.dtype == torch.int64 and idx.is_contiguous():
                _native.gather_rows(
                    rows.data_ptr(),
                    data.data_ptr(),
                    self.record_bytes,
                    self.slots,
                    idx.data_ptr(),
                    idx.shape[0],
                    base,
                    torch.get_num_threads(),  # large gathers split as torch's copies are
                )
                return
        else:  # CUDA only: indices checked on the host (a device-side assert is fatal), then up
            idx = slots
            if idx.is_cpu and base < 0 and idx.numel():
                lo, hi = int(idx.min()), int(idx.max())
                if lo < 0 or hi >= self.slots:
                    raise IndexError(
                        f"{self.kind} tier gather: expected slots in [0, {self.slots}), "
                        f"got {lo}..{hi}"
                    )
        if data.is_cuda and idx.is_cpu:  # CUDA only: up into the tier's reused index buffer
            if idx.dtype not in (torch.int64, torch.int32):
                raise TypeError(f"{self.kind} tier gather: expected int64 slots, got {idx.dtype}")
            if self._uploads is None:
                self._uploads = IndexUpload(data.device)
            with self._uploads.use(idx) as up:
                if base >= 0:
                    up.remainder_(self.slots)  # the tier's own buffer: in place, no allocation
                torch.index_select(data.view(torch.int64), 0, up, out=rows.view(torch.int64))
            return
        if base >= 0:
            idx = idx.remainder(self.slots)
        idx = upload(idx, data.device)
        torch.index_select(data.view(torch.int64), 0, idx, out=rows.view(torch.int64))

    def _scratch(self, n: int, pinned: bool) -> torch.Tensor:
        """Contiguous rows on the tier's device for a gather that ``out`` cannot take directly.

        A CUDA tier's come from torch's caching allocator on the current stream (reused in
        stream order); rows for a CUDA ``out`` from a host tier are pinned, from the caching host
        allocator (kept until the copy out of them has run); host rows for a host ``out`` are
        one buffer kept on the tier (every use ends before ``gather`` returns), so its pages are
        touched once, not at every gather.
        """
        shape = (n, self.record_bytes)
        if self.data.is_cuda:  # CUDA only
            return torch.empty(shape, dtype=torch.uint8, device=self.data.device)
        if pinned:  # CUDA only
            return torch.empty(shape, dtype=torch.uint8, pin_memory=True)
        if self._host_rows is None or self._host_rows.shape[0] < n:
            self._host_rows = torch.empty(shape, dtype=torch.uint8)
        return self._host_rows[:n]

    def write(self, start: int, records: torch.Tensor) -> None:
        """Copy ``records`` (any device) into slots ``[start, start + len(records))``.

        Into device memory the copy is asynchronous, on the current stream (from pinned host
        memory: keep ``records`` unchanged until that stream has passed the copy). Into host
        memory it is synchronous: a copy from CUDA waits for the current stream, not the device
        (why: ``tiers/cuda.py``), so the host readers of these slots never see them half landed.
        """
        dst = self.region(start, start + records.shape[0])
        dst.copy_(records, non_blocking=dst.is_cuda)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of the tier's contents (on the tier's device, ordered on the current stream
        for a CUDA tier): later rounds, which overwrite the slots, do not change it. A disk
        tier's is copied into host memory (checkpoints write items from the slots instead,
        ``checkpoint/snapshot.py``, without calling this)."""
        return {"data": self.data.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore contents saved by :meth:`state_dict` (same slots and record size).

        Raises:
            ConfigError: on a different shape.
        """
        data = state["data"]
        if data.shape != self.data.shape:
            raise ConfigError(
                f"{self.kind} tier data: expected shape {list(self.data.shape)}, "
                f"got {list(data.shape)}"
            )
        self.region(0, self.slots).copy_(data)  # through region: a running checkpoint's guard

    def close(self) -> None:
        """Release the tier's memory or files."""


def tier_stats(tier: Tier, items: int) -> dict[str, object]:
    """One tier's entry in ``Storage.stats()["tiers"]``."""
    return {
        "kind": tier.kind,
        "items": items,
        "bytes": items * tier.record_bytes,
        "capacity_bytes": tier.capacity_bytes,
        "read_gbps": tier.read_gbps,
        "write_gbps": tier.write_gbps,
        "bandwidth_source": tier.bandwidth_source,
    }


class Storage(ABC):
    """One rank's shard of the store: what rounds, samplers and checkpoints may ask of it.

    Items are addressed by generation (see the module docstring). Implemented by
    :class:`~conduit_dist.tiers.shard.Shard` (one tier, a ring) and
    :class:`~conduit_dist.tiers.tiered.TieredShard` (several tiers, demotion); a round calls
    these from one thread at a time (``stats`` may be called from any thread).

    Attributes:
        capacity: items the shard holds at most.
        size: live items.
        written: items ever written: the next item's generation.
    """

    capacity: int
    size: int
    written: int

    # ------------------------------------------------------------------ what is stored

    @property
    def oldest(self) -> int:
        """Generation of the oldest live item (live: ``oldest .. written - 1``)."""
        return self.written - self.size

    @property
    @abstractmethod
    def tiers(self) -> list[Tier]:
        """The tiers, fastest first."""

    # ------------------------------------------------------------------ writes

    @abstractmethod
    def append(self, records: torch.Tensor) -> None:
        """Write ``records`` (oldest first) as the newest items; beyond the capacity the oldest
        items are evicted (or demoted down the tiers).

        Args:
            records: ``uint8 [n, record_bytes]`` on any device, copied into the tier
                (``Tier.write``: into host memory the copy has landed when this returns).
        """

    @abstractmethod
    def reserve(self, ahead: int, n: int) -> tuple[int, list[torch.Tensor]] | None:
        """Rows for ``n`` items written ``ahead`` items past the newest, before they count.

        For writes ahead of a round (``put`` writes into the rows; the round calls
        :meth:`commit`). Asking again for the same ``ahead`` and ``n`` before the commit gives
        the same rows.

        Returns:
            ``(skip, views)``: the first ``skip`` items get no row (more than the capacity: only
            the newest fit), the rest fill ``views`` in order; ``None`` when the shard cannot take
            writes ahead now (the caller stages the items instead).
        """

    @abstractmethod
    def overwrites_live(self, ahead: int, n: int) -> bool:
        """Whether the rows :meth:`reserve` gives for ``(ahead, n)`` held live items (a ring
        writes ahead over its oldest items once full; they leave when the rows are committed)."""

    @abstractmethod
    def receive(self, n: int) -> torch.Tensor | None:
        """Contiguous rows for the next ``n`` items (a collective receives into them), counted
        by :meth:`commit`; ``None`` when they would not be contiguous (then :meth:`append`).

        The rows are on the first tier's device (``tiers[0].data.device``): a caller whose
        collective runs on another device receives elsewhere and calls :meth:`append`."""

    @abstractmethod
    def commit(self, n: int) -> None:
        """Count ``n`` items written into rows from :meth:`reserve` or :meth:`receive`."""

    @abstractmethod
    def take_oldest(self, n: int) -> None:
        """Remove the ``n`` oldest items (a queue delivered them, or they were too old)."""

    @abstractmethod
    def take_newest(self, n: int) -> None:
        """Remove the ``n`` newest items (a LIFO delivered them): their generations are reused."""

    # ------------------------------------------------------------------ reads

    @abstractmethod
    def gather(self, generations: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the live items ``generations`` into ``out``, on any device (``Tier.gather``).

        Args:
            generations: int64 generations of live items (on the host).
            out: ``uint8 [n, record_bytes]`` on any device, any strides. In host memory its rows
                are readable on the host when this returns; in CUDA memory they are ordered on
                the current stream.
        """

    @abstractmethod
    def locate(self, generations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tier, slot)`` int64 tensors: where the live items ``generations`` are stored (for a
        checkpoint's copy-on-write snapshot; call after :meth:`settle`)."""

    # ------------------------------------------------------------------ between rounds

    def settle(self) -> None:  # noqa: B027 (default: nothing runs in the background)
        """Wait for background work (demotion) to finish."""

    def demote_ahead(self, n: int) -> None:  # noqa: B027 (default: nothing to do)
        """After a round: make room for ``n`` items in the background."""

    def ahead_evictions(self, sizes: np.ndarray, inflow: np.ndarray) -> np.ndarray | None:
        """Items every shard's :meth:`demote_ahead` evicts before the next round, from
        replicated inputs (``[world]`` sizes and inflows); ``None``: nothing runs ahead."""
        return None

    # ------------------------------------------------------------------ state

    @abstractmethod
    def reset(self, base: int) -> None:
        """Empty the shard; the next item written gets generation ``base`` (a restore)."""

    @abstractmethod
    def stats(self) -> dict[str, object]:
        """Items and bytes per tier, demotions, evictions, items taken, demotion waits."""

    @abstractmethod
    def state_dict(self) -> dict[str, object]:
        """Positions, counters and a copy of every tier's contents (later rounds change none
        of it)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict` (same tiers and sizes)."""

    @abstractmethod
    def close(self) -> None:
        """Release the tiers (disk files are removed)."""
