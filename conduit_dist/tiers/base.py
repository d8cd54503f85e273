"""The tier interface: a fixed number of record slots in one kind of memory.

Every tier keeps its slots as one ``uint8 [slots, record_bytes]`` tensor, ``self.data``, set by
the subclass (device memory, pinned or pageable host memory, a memory-mapped file); reads and
writes are tensor ops on it, so they are written once, here.
"""

from __future__ import annotations

import time

import torch

from conduit_dist.errors import ConfigError
from conduit_dist.records.spec import _native


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
        cuda = self.data.device.type == "cuda"
        best_w = best_r = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.write(0, src)
            if cuda:
                torch.cuda.synchronize(self.data.device)
            t1 = time.perf_counter()
            self.gather(idx, out)
            if cuda:
                torch.cuda.synchronize(self.data.device)
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
        keeps what those slots held (copy-on-write)."""
        guard = self.guard  # read once: a finishing checkpoint clears it from its thread
        if guard is not None:
            guard(start, end)
        return self.data[start:end]

    def gather(self, slots: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the records at ``slots`` (int64) into ``out`` (``[len(slots), record_bytes]``).

        In host memory (and memory-mapped files) a native loop copies whole rows, prefetching a
        few rows ahead: random rows of a large store miss the caches, and overlapping the misses
        made a 256-row gather of 536-byte records ~2x faster than ``index_select`` here. Elsewhere
        rows are moved as int64 words (records are 8-byte multiples): ``index_select`` copies
        element by element, and 8x fewer elements made it ~4x faster for small records.

        Raises:
            ValueError: if ``out`` is not ``uint8 [len(slots), record_bytes]``.
            IndexError: on a slot outside the tier (host memory; checked before any copy).
        """
        data = self.data
        if (
            out.dtype != torch.uint8
            or out.dim() != 2
            or out.shape != (len(slots), self.record_bytes)
        ):
            raise ValueError(
                f"{self.kind} tier gather: expected out uint8 [{len(slots)}, {self.record_bytes}], "
                f"got {out.dtype} {list(out.shape)}"
            )
        if (
            _native is not None
            and data.is_cpu
            and out.is_cpu
            and slots.is_cpu
            and out.is_contiguous()
            and slots.dtype == torch.int64
            and slots.is_contiguous()
        ):
            _native.gather_rows(
                out.data_ptr(),
                data.data_ptr(),
                self.record_bytes,
                self.slots,
                slots.data_ptr(),
                slots.shape[0],
            )
            return
        idx = slots if slots.device == data.device else slots.to(data.device, non_blocking=True)
        torch.index_select(data.view(torch.int64), 0, idx, out=out.view(torch.int64))

    def write(self, start: int, records: torch.Tensor) -> None:
        """Copy ``records`` into slots ``[start, start + len(records))`` (async from pinned)."""
        self.region(start, start + records.shape[0]).copy_(records, non_blocking=True)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The tier's contents."""
        return {"data": self.data}

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
