"""One rank's shard of the experience store: a FIFO ring of record slots over a tier."""

from __future__ import annotations

import torch

from conduit_dist.errors import ConfigError
from conduit_dist.tiers.base import Tier


class Shard:
    """A ring of ``tier.slots`` records; when full, the oldest records are overwritten first.

    Slot ``i`` holds the item written ``generation[i]``-th on this shard, so a global address
    ``(rank, slot, generation)`` identifies an item even after its slot is reused.

    Args:
        tier: where the records live.
    """

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self.capacity = tier.slots
        self.write_pos = 0
        self.size = 0
        self.written = 0  # items ever written (the next item's generation)
        self.taken = 0  # items a queue took out
        self.retracted = 0  # of those, taken at the newest end (their generations are reused)
        self.base = 0  # generation of the first item written (a restore starts past 0)

    @property
    def oldest(self) -> int:
        """Generation of the oldest live item (live items: ``oldest .. written - 1``)."""
        return self.written - self.size

    def index_of(self, generations: torch.Tensor) -> torch.Tensor:
        """Gather indices of live items by generation (their slots)."""
        return generations % self.capacity

    def generations(self, index: torch.Tensor) -> torch.Tensor:
        """Generations of the live items at gather indices (inverse of :meth:`index_of`)."""
        return self.oldest + (index - self.oldest) % self.capacity

    def leaf_of(self, index: torch.Tensor) -> torch.Tensor:
        """``generation % capacity`` of the items at gather indices: the index itself here."""
        return index

    def index_of_leaf(self, leaf: torch.Tensor, generation: torch.Tensor) -> torch.Tensor:
        """Gather indices of the items at leaves ``leaf`` (whose generations are
        ``generation[leaf]``): the leaves themselves here."""
        return leaf

    def live(self, index: torch.Tensor) -> torch.Tensor:
        """Gather indices of the live items at positions ``index`` in ``[0, size)`` (in place):
        the positions themselves until items were taken out (the live slots are then a
        window of the ring that need not start at slot 0)."""
        if self.taken or self.base % self.capacity:
            index.add_(self.oldest).remainder_(self.capacity)
        return index

    def take_oldest(self, n: int) -> None:
        """Remove the ``n`` oldest items (a queue delivered them)."""
        if not 0 <= n <= self.size:
            raise ValueError(f"take_oldest: expected 0..{self.size} items, got {n}")
        self.size -= n
        self.taken += n

    def take_newest(self, n: int) -> None:
        """Remove the ``n`` newest items (a LIFO delivered them): the write position moves
        back, so their slots and generations are reused."""
        if not 0 <= n <= self.size:
            raise ValueError(f"take_newest: expected 0..{self.size} items, got {n}")
        self.size -= n
        self.written -= n
        self.write_pos = (self.write_pos - n) % self.capacity
        self.taken += n
        self.retracted += n

    def receive_region(self, n: int) -> torch.Tensor | None:
        """Slots the next ``n`` items would occupy, as one contiguous view, if they do not wrap.

        Lets a collective receive straight into storage; ``None`` when the write would wrap or
        exceed the capacity (then :meth:`append` from a separate buffer).
        """
        if n > self.capacity or self.write_pos + n > self.capacity:
            return None
        return self.tier.region(self.write_pos, self.write_pos + n)

    def direct_views(self, ahead: int, n: int) -> tuple[int, list[torch.Tensor]]:
        """Storage rows for ``n`` items written ``ahead`` items past the write position.

        For writes ahead of a round at world size 1: the slots count once :meth:`commit` is
        called. The ring wraps (two views); of more than ``capacity`` items only the newest
        ``capacity`` get rows, as if written in order.

        Returns:
            ``(skip, views)``: the first ``skip`` items get no row, the rest fill ``views`` in
            order.
        """
        cap = self.capacity
        keep = min(n, cap)
        start = (self.write_pos + ahead + n - keep) % cap
        first = min(keep, cap - start)
        views = [self.tier.region(start, start + first)]
        if first < keep:
            views.append(self.tier.region(0, keep - first))
        return n - keep, views

    def overwrites_live(self, ahead: int, n: int) -> bool:
        """Whether writing ``n`` items ``ahead`` past the write position reaches live items."""
        return self.size + ahead + n > self.capacity

    def demote_ahead(self, n: int) -> None:
        """Nothing to do for one tier (overwriting the oldest slots is the eviction)."""

    def ahead_evictions(self, sizes, inflow):
        """Items every shard's demoter evicts before the next round: none for one tier.

        Returns:
            ``None`` (nothing runs ahead), or ``int64 [world]`` to subtract from ``sizes``.
        """
        return None

    def settle(self) -> None:
        """Nothing runs in the background for one tier."""

    def stats(self) -> dict[str, object]:
        """Items and bytes in the tier (one tier: nothing is demoted; overwrites are evictions)."""
        tier = self.tier
        tiers = [
            {
                "kind": tier.kind,
                "items": self.size,
                "bytes": self.size * tier.record_bytes,
                "capacity_bytes": tier.capacity_bytes,
                "read_gbps": tier.read_gbps,
                "write_gbps": tier.write_gbps,
                "bandwidth_source": tier.bandwidth_source,
            }
        ]
        return {
            "tiers": tiers,
            "demotions": 0,
            "evictions": self.written - self.base + self.retracted - self.size - self.taken,
            "taken": self.taken,
            "demotion_wait_ms": 0.0,
        }

    def close(self) -> None:
        """Release the tier."""
        self.tier.close()

    def commit(self, n: int) -> None:
        """Account for ``n`` items already written at the write position."""
        self.written += n
        self.write_pos = (self.write_pos + n) % self.capacity
        self.size = min(self.capacity, self.size + n)

    def append(self, records: torch.Tensor) -> None:
        """Write records in order; if more than the capacity arrive, only the newest are kept."""
        n = records.shape[0]
        if n == 0:
            return
        skip = max(0, n - self.capacity)
        if skip:
            self.written += skip
            self.write_pos = (self.write_pos + skip) % self.capacity
            records = records[skip:]
            n = records.shape[0]
        first = min(n, self.capacity - self.write_pos)
        self.tier.write(self.write_pos, records[:first])
        if first < n:
            self.tier.write(0, records[first:])
        self.commit(n)

    def gather(self, slots: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the records at ``slots`` into ``out``."""
        self.tier.gather(slots, out)

    @property
    def tiers(self) -> list[Tier]:
        """The tiers, fastest first (one here)."""
        return [self.tier]

    def locate(self, generations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tier, slot)`` int64 tensors: where the live items ``generations`` are stored."""
        return torch.zeros_like(generations), generations % self.capacity

    def reset(self, base: int) -> None:
        """Empty the shard; the next item written gets generation ``base`` (a restore)."""
        self.written, self.size, self.taken, self.retracted = base, 0, 0, 0
        self.base, self.write_pos = base, base % self.capacity

    def state_dict(self) -> dict[str, object]:
        """Ring position, size and the tier's contents."""
        return {
            "write_pos": self.write_pos,
            "size": self.size,
            "written": self.written,
            "taken": self.taken,
            "retracted": self.retracted,
            "base": self.base,
            "tier": self.tier.state_dict(),
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore a shard saved by :meth:`state_dict` with the same capacity and record size."""
        if not 0 <= int(state["size"]) <= self.capacity:
            raise ConfigError(f"shard size: expected 0..{self.capacity}, got {state['size']}")
        self.tier.load_state_dict(state["tier"])
        self.write_pos, self.size, self.written = (
            int(state["write_pos"]),
            int(state["size"]),
            int(state["written"]),
        )
        self.taken = int(state.get("taken", 0))
        self.retracted = int(state.get("retracted", 0))
        self.base = int(state.get("base", 0))
