"""What every rank keeps identical about the store: every shard's size, each shard's inflow in
the latest round, the items ingested over all ranks, and the sizes as of the latest completed
round (what ``plane.stored`` reads). Rounds update it from replicated inputs only (the meta, the
plan, the allocation), so no exchange is needed to keep it in step."""

from __future__ import annotations

import numpy as np
import torch


class Replicated:
    """The replicated store state of one plane.

    Args:
        world: number of shards.
    """

    def __init__(self, world: int) -> None:
        self.sizes = np.zeros(world, dtype=np.int64)  # every shard's size, now
        self.published = self.sizes.copy()  # as of the latest completed round
        self.inflow = self.sizes.copy()  # items each shard took in this round
        self.ingested = 0  # items ingested over all ranks

    def ingested_now(self, inflow: np.ndarray, sizes: np.ndarray) -> None:
        """This round's ingestion: each shard's inflow and its size once the items are in."""
        self.inflow, self.sizes = inflow, sizes
        self.ingested += sum(inflow.tolist())  # a few values: Python beats numpy's call cost

    def remove(self, per_shard: np.ndarray) -> None:
        """Items every shard lost (stale, taken by a queue, evicted ahead by demotion)."""
        self.sizes = self.sizes - per_shard

    def publish(self) -> int:
        """The round completed: its sizes become what ``plane.stored`` reads; returns the total."""
        self.published = self.sizes.copy()
        return sum(self.published.tolist())  # a few values: Python beats numpy's call cost

    def state_dict(self) -> dict[str, object]:
        """Every shard's size and the items ingested."""
        return {"sizes": torch.from_numpy(self.sizes.copy()), "ingested": self.ingested}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict` (same world size)."""
        self.restore(state["sizes"].numpy().astype(np.int64), int(state["ingested"]))

    def restore(self, sizes: np.ndarray, ingested: int) -> None:
        """Set the state after a restore onto any world size."""
        self.sizes, self.published = sizes.copy(), sizes.copy()
        self.inflow = np.zeros_like(self.sizes)
        self.ingested = int(ingested)
