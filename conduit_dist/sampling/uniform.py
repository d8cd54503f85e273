"""Exact uniform sampling with replacement over the global (sharded) store.

A learner's batch of ``b`` items is split over shards by a multinomial draw with probabilities
``n_s / N`` (shard sizes, known to every rank after the round's meta exchange); each shard then
draws its share uniformly from its own items. Every stored item is equally likely whichever shard
holds it, and draws are independent: the batch is i.i.d. uniform over the global store (grouped by
shard, not shuffled). The multinomial generator is seeded by ``(seed, round)`` so every rank
computes the same allocation without a further exchange.
"""

from __future__ import annotations

import numpy as np
import torch

from conduit_dist.sampling.base import Sampler, seeded


class Uniform(Sampler):
    """Each learner's batch i.i.d. uniform over every item of every shard."""

    name = "uniform"

    def allocate(
        self, requests: np.ndarray, sizes: np.ndarray, round: int, meta: np.ndarray
    ) -> np.ndarray:
        """Per-learner multinomial split over shards in proportion to their sizes."""
        if sizes.shape[0] == 1:  # one shard: it supplies every draw
            return np.array([[requests[0] if sizes[0] else 0]], dtype=np.int64)
        world = sizes.shape[0]
        counts = np.zeros((world, world), dtype=np.int64)
        if int(sizes.sum()) == 0 or not requests.any():
            return counts
        gen = seeded(self._alloc_gen, self.ctx.seed, round, 0x5A11)
        probs = torch.from_numpy(sizes.astype(np.float64))
        for learner in np.nonzero(requests)[0]:
            draws = torch.multinomial(
                probs, int(requests[learner]), replacement=True, generator=gen
            )
            counts[learner] = torch.bincount(draws, minlength=world).numpy()
        return counts

    def expected(self, requests: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """``requests[l] * n_s / N``."""
        total = sizes.sum()
        if total == 0:
            return np.zeros((sizes.shape[0], sizes.shape[0]))
        return requests[:, None] * (sizes[None, :] / total)
