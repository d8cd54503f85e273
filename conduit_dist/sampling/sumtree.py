"""Sum and min trees over a shard's slots: O(log n) updates and draws, vectorised per call.

Leaves ``0 .. P-1`` (``P`` the capacity rounded up to a power of two) hold float64 masses; node
``i`` has children ``2i`` and ``2i + 1`` and node 1 is the root, so the root is the shard's
total mass and the min tree's root its smallest positive mass. A dead leaf has mass 0 (min
``+inf``). With the native extension a call is one C loop over its items; without it the same
trees are updated and descended level by level with torch ops (no Python loop per item).
"""

from __future__ import annotations

import math

import torch

from conduit_dist.sampling.base import seeded
from conduit_dist.spec import _native


class SumTree:
    """Masses of ``capacity`` leaves with their sums and minima.

    Args:
        capacity: number of leaves in use (``>= 1``).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)
        self.P = 1 << max(0, math.ceil(math.log2(max(1, self.capacity))))
        self.sum = torch.zeros(2 * self.P, dtype=torch.float64)
        self.min = torch.full((2 * self.P,), math.inf, dtype=torch.float64)
        self._gen = torch.Generator()

    @property
    def total(self) -> float:
        """Sum of every leaf."""
        return float(self.sum[1])

    @property
    def smallest(self) -> float:
        """The smallest positive leaf (``inf`` when every leaf is 0)."""
        return float(self.min[1])

    def leaves(self) -> torch.Tensor:
        """The leaf masses (a view: ``[capacity]`` float64)."""
        return self.sum[self.P : self.P + self.capacity]

    def set(self, idx: torch.Tensor, val: torch.Tensor) -> None:
        """Set leaves ``idx`` (int64) to ``val`` (float64 >= 0); the last of duplicates wins."""
        idx = idx.contiguous()
        val = val.to(torch.float64).contiguous()
        n = idx.numel()
        if n == 0:
            return
        if _native is not None:
            _native.tree_set(
                self.sum.data_ptr(), self.min.data_ptr(), self.P, idx.data_ptr(),
                val.data_ptr(), n,
            )  # fmt: skip
            return
        node = idx + self.P
        self.sum[node] = val  # index_put keeps the last write of duplicates
        self.min[node] = torch.where(val > 0, val, torch.full_like(val, math.inf))
        for _ in range(self.P.bit_length() - 1):  # every leaf is at the same depth
            node = torch.unique(node >> 1)
            self.sum[node] = self.sum[2 * node] + self.sum[2 * node + 1]
            self.min[node] = torch.minimum(self.min[2 * node], self.min[2 * node + 1])

    def load(self, leaves: torch.Tensor) -> None:
        """Replace every leaf (``[capacity]`` float64) and rebuild the sums bottom-up."""
        self.sum.zero_()
        self.sum[self.P : self.P + self.capacity] = leaves.to(torch.float64)
        lv = self.sum[self.P :]
        self.min[self.P :] = torch.where(lv > 0, lv, torch.full_like(lv, math.inf))
        width = self.P // 2
        while width >= 1:
            lo = width
            self.sum[lo : 2 * lo] = (
                self.sum[2 * lo : 4 * lo : 2] + self.sum[2 * lo + 1 : 4 * lo : 2]
            )
            self.min[lo : 2 * lo] = torch.minimum(
                self.min[2 * lo : 4 * lo : 2], self.min[2 * lo + 1 : 4 * lo : 2]
            )
            width //= 2

    def sample(
        self, n: int, seed: int, round: int, key: int, out: torch.Tensor, mass: torch.Tensor
    ) -> None:
        """Draw ``n`` leaves i.i.d. with probability ``leaf / total`` from the stream
        ``(seed, round, key)`` into ``out`` (int64) and their masses into ``mass`` (float64).

        Raises:
            ValueError: if the total mass is not positive.
        """
        if n == 0:
            return
        if _native is not None:
            _native.tree_sample(
                self.sum.data_ptr(), self.P, n, seed, round, key, out.data_ptr(),
                mass.data_ptr(),
            )  # fmt: skip
            return
        total = self.total
        if not total > 0:
            raise ValueError(f"sample: expected a positive total mass, got {total}")
        gen = seeded(self._gen, seed, round, key)
        u = torch.rand(n, dtype=torch.float64, generator=gen) * total
        node = torch.ones(n, dtype=torch.int64)
        for _ in range(self.P.bit_length() - 1):
            left = self.sum[2 * node]
            right = self.sum[2 * node + 1]
            go_left = ((u < left) & (left > 0)) | ~(right > 0)
            u = torch.where(go_left, u, u - left)
            node = torch.where(go_left, 2 * node, 2 * node + 1)
        out[:n] = node - self.P
        mass[:n] = self.sum[node]
