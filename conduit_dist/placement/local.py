"""``local`` placement: items stay on the rank that put them (no ingestion collective)."""

from __future__ import annotations

import numpy as np

from conduit_dist.placement.base import Placement


class Local(Placement):
    """Every item is stored on the shard of the rank that put it."""

    name = "local"
    keeps_local = True

    def plan(
        self, staged: np.ndarray, requests: np.ndarray, sizes: np.ndarray, capacity: int
    ) -> np.ndarray:
        """The diagonal plan."""
        return np.diag(staged).astype(np.int64)
