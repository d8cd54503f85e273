"""Stratified sampling: shards contribute in proportion to their sizes, learners read locally first.

Over all learners of a round, shard ``s`` supplies ``t_s`` items with ``t_s / sum(t) = n_s / N``
(largest-remainder rounding, ties broken by a generator seeded from ``(seed, round)``), drawn
uniformly within the shard. So the *union* of the learners' batches is a proportionally
stratified sample of the global store: every item has the same inclusion probability, with lower
variance than independent uniform draws. Supplies are then matched to learners local-first (a
learner takes from its own shard, then from the nearest shards), so colocated learners over
balanced shards read only their own shard. The price: one learner's batch is **not** a uniform
sample of the global store (with balanced shards it is a uniform sample of its own shard); with
data-parallel learners whose gradients are averaged, the averaged gradient is over the stratified
global batch. Use ``uniform`` when each learner's batch must be uniform on its own.
"""

from __future__ import annotations

import numpy as np
import torch

from conduit_dist.sampling.base import Sampler, seeded


class Stratified(Sampler):
    """Proportional over shards for the union of the learners' batches, read local-first."""

    name = "stratified"

    def __init__(self) -> None:
        super().__init__()
        self._gen = torch.Generator()  # reseeded from (seed, round) for rounding ties

    def allocate(
        self, requests: np.ndarray, sizes: np.ndarray, round: int, meta: np.ndarray
    ) -> np.ndarray:
        """Per-learner, per-shard counts (``[learner, shard]``) of a stratified round."""
        world = sizes.shape[0]
        counts = np.zeros((world, world), dtype=np.int64)
        total_items, demand = int(sizes.sum()), int(requests.sum())
        if total_items == 0 or demand == 0:
            return counts
        exact = demand * sizes / total_items
        supply = np.floor(exact).astype(np.int64)
        short = demand - int(supply.sum())
        if short:
            g = seeded(self._gen, self.ctx.seed, round, 0x57A7)
            jitter = torch.rand(world, generator=g, dtype=torch.float64).numpy() * 1e-9
            order = np.argsort(-(exact - supply + jitter), kind="stable")
            supply[order[:short]] += 1
        need = requests.astype(np.int64).copy()
        for learner in np.nonzero(need)[0]:  # own shard first
            take = min(need[learner], supply[learner])
            counts[learner, learner] += take
            need[learner] -= take
            supply[learner] -= take
        links = self.ctx.links
        for learner in np.nonzero(need)[0]:
            for shard in sorted(range(world), key=lambda s: (links[s, learner], s)):
                if need[learner] == 0:
                    break
                take = min(need[learner], supply[shard])
                counts[learner, shard] += take
                need[learner] -= take
                supply[shard] -= take
        return counts

    def expected(self, requests: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """The allocation itself (it is deterministic up to rounding ties)."""
        return self.allocate(requests, sizes, 0, np.zeros((sizes.shape[0], 0))).astype(float)
