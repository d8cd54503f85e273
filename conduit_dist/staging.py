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
        self._bufs[self._cur].count = 0
        return full
