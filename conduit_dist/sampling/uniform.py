"""Exact uniform sampling with replacement over the global (sharded) store.

A learner's batch of ``b`` items is split over shards by a multinomial draw with probabilities
``n_s / N`` (shard sizes, known to every rank after the round's meta exchange); each shard then
draws its share uniformly from its own items. Every stored item is equally likely whichever shard
holds it, and draws are independent: the batch is i.i.d. uniform over the global store (grouped by
shard, not shuffled). The multinomial is drawn as ``b`` items uniform over the global store's
``N`` items (a stream keyed by ``(seed, round, learner)``, the same on every rank), each counted
for the shard that holds it: every rank computes the same allocation without a further exchange.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np

from conduit_dist.records.spec import _native
from conduit_dist.sampling.base import Sampler, Speculative, proportional, splitmix_uniform

_KEY = 1 << 40  # allocation streams: (seed, round, _KEY + learner), apart from the draw streams


class _AllocBuffers(NamedTuple):
    """The native allocation's arrays, reused round after round, and their addresses (numpy's
    ``ctypes.data`` builds an object a call: ~1 us each)."""

    ends: np.ndarray
    requests: np.ndarray
    counts: np.ndarray
    ends_p: int
    requests_p: int
    counts_p: int

    @staticmethod
    def new(world: int) -> _AllocBuffers:
        ends, req = np.empty(world, dtype=np.int64), np.empty(world, dtype=np.int64)
        counts = np.empty((world, world), dtype=np.int64)
        return _AllocBuffers(
            ends, req, counts, ends.ctypes.data, req.ctypes.data, counts.ctypes.data
        )


class Uniform(Speculative, Sampler):
    """Each learner's batch i.i.d. uniform over every item of every shard (a shard's draws are
    i.i.d. whatever its share: :class:`Speculative`)."""

    name = "uniform"
    _bufs: _AllocBuffers | None = None

    def __getstate__(self) -> dict:
        """A copy (``copy.deepcopy``, pickle) rebuilds its own allocation buffers: the cached
        addresses are this object's arrays'."""
        return {k: v for k, v in self.__dict__.items() if k != "_bufs"}

    def allocate(
        self, requests: np.ndarray, sizes: np.ndarray, round: int, meta: np.ndarray
    ) -> np.ndarray:
        """Per-learner multinomial split over shards in proportion to their sizes."""
        if sizes.shape[0] == 1:  # one shard: it supplies every draw
            return np.array([[requests[0] if sizes[0] else 0]], dtype=np.int64)
        world = sizes.shape[0]
        if _native is not None:  # one call for every learner (~2 us)
            bufs = self._bufs
            if bufs is None or bufs.ends.shape[0] != world:
                bufs = self._bufs = _AllocBuffers.new(world)
            if world <= 64:  # a few values: Python beats numpy's cumsum (~2 us)
                bufs.ends[:] = list(itertools.accumulate(sizes.tolist()))
            else:
                np.cumsum(sizes, out=bufs.ends)
            if bufs.ends[-1] == 0:  # an empty store (a learner without a request draws nothing)
                return np.zeros((world, world), dtype=np.int64)
            bufs.requests[:] = requests
            _native.uniform_alloc(
                bufs.counts_p, world, bufs.ends_p, bufs.requests_p, self.ctx.seed, round, _KEY
            )
            return bufs.counts.copy()  # the caller keeps it; the buffer is next round's
        counts = np.zeros((world, world), dtype=np.int64)
        ends = np.cumsum(sizes)
        if ends[-1] == 0:
            return counts
        for learner in np.nonzero(requests)[0]:  # the same stream without the extension
            n, key = int(requests[learner]), _KEY + int(learner)
            items = splitmix_uniform(n, int(ends[-1]), self.ctx.seed, round, key)
            shards = np.searchsorted(ends, np.array(items, dtype=np.int64), side="right")
            counts[learner] = np.bincount(shards, minlength=world)
        return counts

    def expected(self, requests: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """``requests[l] * n_s / N``."""
        return proportional(requests, sizes)
