"""The disk tier: record slots in a memory-mapped file (data beyond RAM)."""

from __future__ import annotations

import os
import uuid

import torch

from conduit_dist.errors import ConfigError
from conduit_dist.tiers.base import Tier


class DiskTier(Tier):
    """Record slots in a file under ``directory``, mapped into memory (the page cache serves hot
    pages; the kernel writes back and evicts the rest).

    Args:
        slots: number of records.
        record_bytes: bytes per record.
        directory: where the file is created (must exist or be creatable).
        keep: leave the file on close (for a checkpoint); removed by default.

    Raises:
        ConfigError: if the directory cannot hold the file.
    """

    kind = "disk"

    def __init__(self, slots: int, record_bytes: int, directory: str, keep: bool = False) -> None:
        super().__init__(slots, record_bytes)
        directory = os.path.expanduser(directory)
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(
            directory, f"conduit-tier-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
        )
        self.keep = keep
        nbytes = slots * record_bytes
        try:
            with open(self.path, "wb") as f:
                f.truncate(nbytes)  # sparse: blocks are allocated as records land
        except OSError as exc:
            raise ConfigError(
                f"disk tier: cannot create {nbytes} bytes at {self.path}: {exc}"
            ) from exc
        self.data = torch.from_file(self.path, shared=True, size=nbytes, dtype=torch.uint8).view(
            slots, record_bytes
        )

    def close(self) -> None:
        """Unmap, and remove the file unless ``keep``."""
        self.data = None
        if not self.keep and os.path.exists(self.path):
            os.remove(self.path)
