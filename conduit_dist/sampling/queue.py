"""FIFO and LIFO queues over the global store: every item delivered to exactly one learner, once.

``allocate`` partitions the shards' items among the learners that fetch, in rank order, all or
nothing: a learner gets its whole request (its own shard's oldest items first, then the other
shards' in rank order) or, when fewer untaken items remain than it asks, nothing (its fetch then
raises, and nothing is taken for it). Each shard gives its oldest items, split among the
learners in rank order, so every learner receives each producer's items in the order they were
put; the round then takes them out of the store (``Takes``): sizes drop on every rank
alike, with no further exchange. Items the ring overwrites before anyone took them are
evictions (``store_stats()``).

:class:`Lifo` is the same with each shard giving its newest items first (learners in rank order
get them newest first); taking them moves the shard's write position back.
"""

from __future__ import annotations

import numpy as np
import torch

from conduit_dist.sampling.base import Sampler, Takes, proportional


class Fifo(Takes, Sampler):
    """First in, first out over every shard; each item to one learner, exactly once."""

    name = "queue"

    def allocate(
        self, requests: np.ndarray, sizes: np.ndarray, round: int, meta: np.ndarray
    ) -> np.ndarray:
        """All-or-nothing per learner, in rank order; own shard first."""
        world = sizes.shape[0]
        left = sizes.astype(np.int64).tolist()
        counts = np.zeros((world, world), dtype=np.int64)
        for learner, want in enumerate(requests.tolist()):
            if want <= 0 or sum(left) < want:
                continue
            order = [learner, *(s for s in range(world) if s != learner)]
            for s in order:
                k = min(want, left[s])
                counts[learner, s] = k
                left[s] -= k
                want -= k
                if not want:
                    break
        return counts

    def taken(self, counts: np.ndarray) -> np.ndarray:
        """Every delivered item leaves its shard."""
        return counts.sum(axis=0)

    def empty_reason(self, batch_size: int, stored: int) -> str:
        """Fewer untaken items than asked."""
        return (
            f"the queue holds {stored} untaken items over all shards after the learners before "
            "this one took theirs, fewer than asked; nothing was taken for this fetch"
        )

    def expected(self, requests: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """Size-proportional (what a queue drains depends on what is left)."""
        return proportional(requests, sizes)

    def draw(self, count: int, round: int, stream: int = 0) -> torch.Tensor:
        """The ``count`` oldest items (oldest first)."""
        first = self.storage.oldest
        return torch.arange(first, first + count, dtype=torch.int64)


class Lifo(Fifo):
    """Last in, first out over every shard; each item to one learner, exactly once."""

    name = "lifo"
    newest_first = True

    def draw(self, count: int, round: int, stream: int = 0) -> torch.Tensor:
        """The ``count`` newest items (newest first)."""
        end = self.storage.written
        return torch.arange(end - 1, end - 1 - count, -1, dtype=torch.int64)
