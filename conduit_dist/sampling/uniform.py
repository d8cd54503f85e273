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

from conduit_dist.sampling.base import seeded


def allocate(
    requests: np.ndarray, sizes: np.ndarray, seed: int, round: int, gen: torch.Generator
) -> np.ndarray:
    """Per-learner, per-shard sample counts for one round.

    Args:
        requests: ``[world]`` batch size each rank asks for (0 for ranks not fetching).
        sizes: ``[world]`` items stored on each shard after this round's ingestion.
        seed: the run seed.
        round: the round number.
        gen: a generator to reseed from ``(seed, round)`` (owned by the caller's plane).

    Returns:
        ``int64 [world, world]``: ``counts[learner, shard]``; rows sum to ``requests``. All zero
        when the store is empty.
    """
    world = sizes.shape[0]
    counts = np.zeros((world, world), dtype=np.int64)
    total = int(sizes.sum())
    if total == 0 or not requests.any():
        return counts
    gen = seeded(gen, seed, round, 0x5A11)
    probs = torch.from_numpy(sizes.astype(np.float64))
    for learner in np.nonzero(requests)[0]:
        draws = torch.multinomial(probs, int(requests[learner]), replacement=True, generator=gen)
        counts[learner] = torch.bincount(draws, minlength=world).numpy()
    return counts


class UniformSampler:
    """Draws a shard's share of each learner's batch, uniformly over the shard's items.

    Args:
        seed: the run seed.
        rank: this shard's rank (mixed into the stream).
    """

    def __init__(self, seed: int, rank: int) -> None:
        self.seed = seed
        self.rank = rank
        self._gen = torch.Generator()

    def slots(self, count: int, size: int, round: int) -> torch.Tensor:
        """``count`` slot indices drawn uniformly with replacement from ``[0, size)``."""
        gen = seeded(self._gen, self.seed, round, self.rank)
        return torch.randint(size, (count,), generator=gen, dtype=torch.int64)

    def state_dict(self) -> dict[str, int]:
        """The sampler is stateless between rounds: streams are derived from (seed, round, rank)."""
        return {"seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore the seed."""
        self.seed = int(state["seed"])
