"""The single-process baseline buffer: what a plain DQN script uses instead of the data plane."""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from conduit_dist.errors import ConfigError, EmptyStoreError
from conduit_dist.plane import RoundStats


class SimpleBuffer:
    """A preallocated ring buffer with the data plane's ``put`` / ``fetch`` / ``flush`` surface.

    World size 1 only; no validation beyond shapes. Used by ``plane.kind=simple`` to compare the
    data plane against a plain buffer with the same hyperparameters.

    Args:
        example: a batch whose fields give shapes and dtypes.
        capacity: items held.
        seed: sampling seed.
        device: where the items are stored and batches delivered (the indices are drawn on the
            host from the CPU generator, the same on any device).

    Raises:
        ConfigError: when used with more than one rank.
    """

    def __init__(
        self,
        example: Mapping[str, torch.Tensor],
        capacity: int,
        seed: int,
        device: torch.device | None = None,
    ) -> None:
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() > 1:
            raise ConfigError(
                f"plane.kind: 'simple' is single-process, got world size {dist.get_world_size()}"
            )
        self.device = device if device is not None else torch.device("cpu")
        self.data = {
            k: torch.empty((capacity, *v.shape[1:]), dtype=v.dtype, device=self.device)
            for k, v in example.items()
        }
        self.capacity, self.pos, self.size = capacity, 0, 0
        self.gen = torch.Generator().manual_seed(seed)
        self.stats = RoundStats()
        self.round = 0

    def __len__(self) -> int:
        """Items stored (every put is stored at once)."""
        return self.size

    stored = property(__len__, doc="Items stored (as ``DataPlane.stored``).")

    def put(self, batch: Mapping[str, torch.Tensor]) -> None:
        """Insert a batch (oldest items overwritten first): at most two slice copies per field."""
        t0 = time.perf_counter()
        n = next(iter(batch.values())).shape[0]
        skip = max(0, n - self.capacity)  # a batch larger than the buffer: only its newest rows
        pos = (self.pos + skip) % self.capacity
        first = min(n - skip, self.capacity - pos)  # up to the end; the rest wraps to the start
        for k, v in batch.items():
            dst = self.data[k]
            dst[pos : pos + first].copy_(v[skip : skip + first])
            if skip + first < n:
                dst[: n - skip - first].copy_(v[skip + first :])
        self.pos = (self.pos + n) % self.capacity
        self.size = min(self.capacity, self.size + n)
        self.stats = RoundStats(round=self.round, ingest_ms=(time.perf_counter() - t0) * 1e3)

    def flush(self) -> None:
        """Nothing to move."""
        self.round += 1

    def fetch(self, batch_size: int) -> dict[str, torch.Tensor]:
        """Uniform sample with replacement: one ``randint``, one ``index_select`` per field."""
        if self.size == 0:
            raise EmptyStoreError("fetch: the buffer is empty")
        t0 = time.perf_counter()
        idx = torch.randint(self.size, (batch_size,), generator=self.gen).to(self.device)
        out = {k: v.index_select(0, idx) for k, v in self.data.items()}
        self.stats.sample_ms = (time.perf_counter() - t0) * 1e3
        self.stats.stored = self.size
        self.round += 1
        return out

    def close(self) -> None:
        """Release memory."""
        self.data = {}
