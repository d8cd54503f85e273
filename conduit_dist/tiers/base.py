"""The tier interface: a fixed number of record slots in one kind of memory."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Tier(ABC):
    """Fixed-size record slots (``uint8 [slots, record_bytes]``) in one kind of memory.

    Args:
        slots: number of records the tier holds.
        record_bytes: bytes per record.
    """

    kind: str = "abstract"

    def __init__(self, slots: int, record_bytes: int) -> None:
        self.slots = slots
        self.record_bytes = record_bytes

    @property
    def capacity_bytes(self) -> int:
        """Bytes this tier holds at most."""
        return self.slots * self.record_bytes

    @abstractmethod
    def region(self, start: int, end: int) -> torch.Tensor:
        """A writable, contiguous view of slots ``[start, end)`` (received into directly)."""

    @abstractmethod
    def gather(self, slots: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the records at ``slots`` (int64) into ``out`` (``[len(slots), record_bytes]``)."""

    def write(self, start: int, records: torch.Tensor) -> None:
        """Copy ``records`` into slots ``[start, start + len(records))`` (async from pinned)."""
        self.region(start, start + records.shape[0]).copy_(records, non_blocking=True)

    @abstractmethod
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The tier's contents as tensors."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore contents saved by :meth:`state_dict`."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the tier's memory or files."""
