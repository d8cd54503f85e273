"""Sum and min trees over a shard's slots: O(log n) updates and draws, vectorised per call.

The trees have fan-out 8, so the children of a node are one 64-byte cache line: a draw or an
update touches ``log8(n)`` lines (7 for a million slots) where a binary tree touches ``log2(n)``
(20), and at replay sizes every level misses the cache. Level 0 holds the leaves (float64
masses), level ``d + 1`` one node per 8 of level ``d``, the last level the root (the shard's
total mass; the min tree's root is its smallest positive mass). Each level is padded to a
multiple of 8 (0 in the sum tree, ``+inf`` in the min tree); a dead leaf has mass 0. With the
native extension a call is one C loop over its items; without it the same trees are updated
and descended level by level with torch ops (no Python loop per item).
"""

from __future__ import annotations

import math

import torch

from conduit_dist.records.buffers import Prefixes
from conduit_dist.records.spec import _native
from conduit_dist.sampling.base import seeded

FAN = 8


_CACHED = ("_ptrs", "_sum_np", "_min_np")  # derived from the arrays: rebuilt by a copy


class SumTree:
    """Masses of ``capacity`` leaves with their sums and minima.

    Args:
        capacity: number of leaves in use (``>= 1``).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)
        sizes = [-(-max(1, self.capacity) // FAN) * FAN]
        while sizes[-1] > FAN:
            sizes.append(-(-(sizes[-1] // FAN) // FAN) * FAN)
        sizes.append(FAN)  # the root's level (one node, padded)
        offs = [0]
        for n in sizes[:-1]:
            offs.append(offs[-1] + n)
        self.H = len(sizes) - 1  # the root is node 0 of level H
        self.offs = torch.tensor(offs, dtype=torch.int64)
        self._offs = offs
        total = offs[-1] + sizes[-1]
        self.sum = torch.zeros(total, dtype=torch.float64)
        self.min = torch.full((total,), math.inf, dtype=torch.float64)
        self._sum_np, self._min_np = self.sum.numpy(), self.min.numpy()  # cheap scalar reads
        self._gen = torch.Generator()
        self._fan = torch.arange(FAN)
        self._vals = Prefixes(torch.float64, torch.device("cpu"), 64)  # fill's values
        # the arrays' addresses (never replaced: every update writes in place) and the height
        self._ptrs = (self.sum.data_ptr(), self.min.data_ptr(), self.offs.data_ptr(), self.H)

    @property
    def total(self) -> float:
        """Sum of every leaf."""
        return float(self._sum_np[self._offs[self.H]])

    @property
    def smallest(self) -> float:
        """The smallest positive leaf (``inf`` when every leaf is 0)."""
        return float(self._min_np[self._offs[self.H]])

    def leaves(self) -> torch.Tensor:
        """The leaf masses (a view: ``[capacity]`` float64)."""
        return self.sum[: self.capacity]

    def set(self, idx: torch.Tensor, val: torch.Tensor) -> None:
        """Set leaves ``idx`` (int64) to ``val`` (float64 >= 0); the last of duplicates wins."""
        idx = idx.contiguous()
        val = val.to(torch.float64).contiguous()
        n = idx.numel()
        if n == 0:
            return
        if _native is not None:
            _native.tree_set(
                self.sum.data_ptr(), self.min.data_ptr(), self.offs.data_ptr(), self.H,
                idx.data_ptr(), val.data_ptr(), n,
            )  # fmt: skip
            return
        self.sum[idx] = val  # index_put keeps the last write of duplicates
        self.min[idx] = torch.where(val > 0, val, torch.full_like(val, math.inf))
        node = idx
        for d in range(1, self.H + 1):
            node = torch.unique(node // FAN)
            kids = self._offs[d - 1] + node[:, None] * FAN + self._fan
            self.sum[self._offs[d] + node] = self.sum[kids].sum(dim=1)
            self.min[self._offs[d] + node] = self.min[kids].min(dim=1).values

    def __getstate__(self) -> dict:
        """A copy (``copy.deepcopy``, pickle) takes its own arrays' addresses and NumPy views:
        the cached ones are this tree's."""
        return {k: v for k, v in self.__dict__.items() if k not in _CACHED}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._sum_np, self._min_np = self.sum.numpy(), self.min.numpy()
        self._ptrs = (self.sum.data_ptr(), self.min.data_ptr(), self.offs.data_ptr(), self.H)

    def fill(self, idx: torch.Tensor, value: float) -> None:
        """Set leaves ``idx`` (int64) to one ``value`` (finite, >= 0): one native call, or
        :meth:`set` through a reused buffer without the extension.

        Raises:
            ValueError: on a value that is negative, infinite or NaN (no leaf changes).
        """
        value = float(value)
        if not 0.0 <= value < math.inf:
            raise ValueError(f"SumTree.fill: expected a finite value >= 0, got {value}")
        n = idx.numel()
        if n == 0:
            return
        if _native is not None and hasattr(_native, "tree_fill"):
            idx = idx.contiguous()
            _native.tree_fill(*self._ptrs, idx.data_ptr(), n, value)
            return
        self.set(idx, self._vals.first(n).fill_(value))

    def load(self, leaves: torch.Tensor) -> None:
        """Replace every leaf (``[capacity]`` float64) and rebuild the levels bottom-up."""
        self.sum.zero_()
        self.min.fill_(math.inf)
        lv = leaves.to(torch.float64)
        self.sum[: self.capacity] = lv
        self.min[: self.capacity] = torch.where(lv > 0, lv, torch.full_like(lv, math.inf))
        for d in range(1, self.H + 1):
            lo, hi = self._offs[d - 1], self._offs[d]
            n = (hi - lo) // FAN
            self.sum[hi : hi + n] = self.sum[lo:hi].view(n, FAN).sum(dim=1)
            self.min[hi : hi + n] = self.min[lo:hi].view(n, FAN).min(dim=1).values

    def sample(
        self,
        n: int,
        seed: int,
        round: int,
        key: int,
        out: torch.Tensor,
        mass: torch.Tensor,
        labels: torch.Tensor | None = None,
    ) -> None:
        """Draw ``n`` leaves i.i.d. with probability ``leaf / total`` from the stream
        ``(seed, round, key)`` into ``out`` (int64; with ``labels``, ``labels[leaf]``, e.g. the
        generation each leaf holds) and their masses into ``mass`` (float64).

        Raises:
            ValueError: if the total mass is not positive.
        """
        if n == 0:
            return
        if _native is not None:
            _native.tree_sample(
                self.sum.data_ptr(), self.offs.data_ptr(), self.H, n, seed, round, key,
                out.data_ptr(), mass.data_ptr(), 0 if labels is None else labels.data_ptr(),
            )  # fmt: skip
            return
        total = self.total
        if not total > 0:
            raise ValueError(f"sample: expected a positive total mass, got {total}")
        gen = seeded(self._gen, seed, round, key)
        u = torch.rand(n, dtype=torch.float64, generator=gen) * total
        node = torch.zeros(n, dtype=torch.int64)
        for d in range(self.H - 1, -1, -1):
            kids = self.sum[self._offs[d] + node[:, None] * FAN + self._fan]  # [n, FAN]
            ends = kids.cumsum(dim=1)
            ok = (u[:, None] < ends) & (kids > 0)
            # the first positive child whose running sum passes u; rounding past the end takes
            # the last positive child
            last = FAN - 1 - (kids > 0).flip(1).int().argmax(dim=1)
            pick = torch.where(ok.any(dim=1), ok.int().argmax(dim=1), last)
            before = torch.where(
                pick > 0, ends.gather(1, (pick - 1).clamp(min=0)[:, None])[:, 0], 0
            )
            u = (u - before).clamp(min=0)
            node = node * FAN + pick
        out[:n] = node if labels is None else labels[node]
        mass[:n] = self.sum[node]
