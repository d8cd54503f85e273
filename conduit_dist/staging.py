"""Growable record buffers for staging and delivery (allocated once, reused every round)."""

from __future__ import annotations

import torch


class RecordBuffer:
    """A reusable ``uint8 [rows, record_bytes]`` buffer that grows by doubling and never shrinks.

    Args:
        record_bytes: bytes per record.
        device: where the buffer lives.
        rows: initial capacity in records.
        pin_memory: allocate page-locked host memory (CUDA machines only).
    """

    def __init__(
        self, record_bytes: int, device: torch.device, rows: int = 256, pin_memory: bool = False
    ) -> None:
        self.record_bytes = record_bytes
        self.device = device
        self.pin_memory = pin_memory
        self.data = self._alloc(max(rows, 1))
        self.count = 0
        self.deferred: list[tuple[int, object]] = []  # (first row, donated batch) to pack later

    def _alloc(self, rows: int) -> torch.Tensor:
        return torch.empty(
            (rows, self.record_bytes),
            dtype=torch.uint8,
            device=self.device,
            pin_memory=self.pin_memory,
        )

    def ensure(self, rows: int) -> None:
        """Grow (keeping the first ``count`` records) so at least ``rows`` records fit."""
        if rows <= self.data.shape[0]:
            return
        new = self._alloc(max(rows, 2 * self.data.shape[0]))
        new[: self.count].copy_(self.data[: self.count])
        self.data = new

    def reserve(self, n: int) -> torch.Tensor:
        """Rows ``[count, count + n)`` to write into; they count once :meth:`commit` is called."""
        self.ensure(self.count + n)
        return self.data[self.count : self.count + n]

    def commit(self, n: int) -> None:
        """Keep ``n`` reserved rows."""
        self.count += n

    def defer(self, n: int, batch: object) -> None:
        """Reserve ``n`` rows for a donated batch, packed later by :meth:`pack_deferred`."""
        self.ensure(self.count + n)
        self.deferred.append((self.count, batch))
        self.count += n

    def pack_deferred(self, spec) -> None:
        """Pack the donated batches into their reserved rows (in the round, not in ``put``)."""
        for start, batch in self.deferred:
            n = next(iter(batch.values())).shape[0]
            spec.pack(batch, self.data[start : start + n])
        self.deferred.clear()

    def drop_oldest(self, k: int) -> None:
        """Drop the first ``k`` committed records (deferred batches must be packed already)."""
        assert not self.deferred, "pack deferred batches before dropping records"
        keep = self.count - k
        self.data[:keep] = self.data[k : self.count].clone()
        self.count = keep

    def reset(self) -> None:
        """Empty the buffer (keeping its memory)."""
        self.count = 0
        self.deferred.clear()

    def rows(self, n: int) -> torch.Tensor:
        """The first ``n`` rows as scratch space (growing if needed; contents not kept)."""
        if n > self.data.shape[0]:
            self.data = self._alloc(max(n, 2 * self.data.shape[0]))
        return self.data[:n]

    def view(self) -> torch.Tensor:
        """The committed records."""
        return self.data[: self.count]


class DoubleBuffer:
    """Two staging buffers: ``put`` fills one while a round reads the other.

    Args:
        record_bytes: bytes per record.
        device: where staged records live.
        pin_memory: page-locked host memory (CUDA machines only).
    """

    def __init__(self, record_bytes: int, device: torch.device, pin_memory: bool = False) -> None:
        self._bufs = [RecordBuffer(record_bytes, device, pin_memory=pin_memory) for _ in range(2)]
        self._cur = 0

    @property
    def current(self) -> RecordBuffer:
        """The buffer ``put`` writes into."""
        return self._bufs[self._cur]

    def take(self) -> RecordBuffer:
        """Hand the filled buffer to a round and switch ``put`` to the other (emptied) one."""
        full = self._bufs[self._cur]
        self._cur ^= 1
        self._bufs[self._cur].reset()
        return full


def _use_count(t: torch.Tensor) -> int | None:
    fn = getattr(torch._C, "_storage_Use_Count", None)
    return None if fn is None else int(fn(t.untyped_storage()._cdata))


class OutputPool:
    """Delivery buffers handed to the caller and reused once the caller has dropped them.

    Touching fresh memory costs far more than copying into memory already touched (first fill
    ~0.5 GB/s here), so a fetched batch lands in one of a few pooled buffers whose storage nobody
    else references any more. Where torch does not expose storage use counts, every batch gets a
    fresh buffer (correct, slower).

    Args:
        record_bytes: bytes per record.
        device: where buffers live.
        size: buffers kept.
    """

    def __init__(self, record_bytes: int, device: torch.device, size: int = 3) -> None:
        self.record_bytes, self.device, self.size = record_bytes, device, size
        self._pool: list[tuple[torch.Tensor, int]] = []  # (buffer, use count when unreferenced)
        self._empty: torch.Tensor | None = None

    def acquire(self, rows: int) -> torch.Tensor:
        """A ``[rows, record_bytes]`` buffer nobody else references."""
        if rows == 0:  # rounds without a fetch: one shared empty tensor
            if self._empty is None:
                self._empty = torch.empty(
                    (0, self.record_bytes), dtype=torch.uint8, device=self.device
                )
            return self._empty
        for buf, idle in self._pool:
            if buf.shape[0] >= rows and _use_count(buf) == idle:
                return buf[:rows]
        buf = torch.empty((rows, self.record_bytes), dtype=torch.uint8, device=self.device)
        idle = _use_count(buf)
        if idle is not None and rows > 0:
            if len(self._pool) >= self.size:
                self._pool.sort(key=lambda e: e[0].shape[0])
                self._pool.pop(0)
            self._pool.append((buf, idle))
        return buf[:rows]  # a view: while the caller holds it, the storage counts as used
