"""Memory tiers: device memory (CUDA), pinned host memory and pageable host memory."""

from __future__ import annotations

import torch

from conduit_dist.collectives.dist import resolve_device
from conduit_dist.errors import ConfigError
from conduit_dist.tiers.base import Tier


class MemoryTier(Tier):
    """Record slots in one preallocated tensor.

    Args:
        slots: number of records.
        record_bytes: bytes per record.
        device: ``cpu`` for host memory, ``cuda[:i]`` for device memory (a bare ``cuda`` is
            resolved to this rank's GPU by ``collectives.dist.resolve_device``).
        pin_memory: page-lock host memory (only meaningful, and only allowed, where CUDA exists).

    Raises:
        ConfigError: for pinned memory without CUDA, or a CUDA device that is not available.
    """

    def __init__(
        self,
        slots: int,
        record_bytes: int,
        device: str | torch.device = "cpu",
        pin_memory: bool = False,
    ) -> None:
        super().__init__(slots, record_bytes)
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"tier device: got {device}, but CUDA is not available")
        if device.type == "cuda":  # cuda:<index>, once: a bare "cuda" is not "GPU 0 on every rank"
            device = resolve_device(device)
        if pin_memory and (device.type != "cpu" or not torch.cuda.is_available()):
            raise ConfigError(
                f"pin_memory: pinned host memory needs device cpu on a CUDA machine, got {device} "
                f"(cuda available: {torch.cuda.is_available()})"
            )
        self.kind = "device" if device.type == "cuda" else ("pinned" if pin_memory else "host")
        self.device = device
        # zero-filled: every page is touched now, not during a round (a first touch is ~20x
        # slower than a copy into memory already touched)
        self.data = torch.zeros(
            (slots, record_bytes), dtype=torch.uint8, device=device, pin_memory=pin_memory
        )
