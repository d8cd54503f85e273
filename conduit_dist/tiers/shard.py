"""One rank's shard of the experience store: a FIFO ring of record slots over one tier."""

from __future__ import annotations

import torch

from conduit_dist.errors import ConfigError
from conduit_dist.tiers.base import Storage, Tier, tier_stats


class Shard(Storage):
    """A ring of ``tier.slots`` records; when full, the oldest records are overwritten first.

    The item of generation ``g`` sits in slot ``g % capacity`` (a restore starts at any base,
    and LIFO takes reuse generations, so the ring's write position is always ``written %
    capacity``), so an address ``(rank, generation)`` identifies an item even after its slot is
    reused.

    Args:
        tier: where the records live.
    """

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self.capacity = tier.slots
        self.size = 0
        self.written = 0  # items ever written (the next item's generation)
        self.taken = 0  # items a queue took out
        self.retracted = 0  # of those, taken at the newest end (their generations are reused)
        self.base = 0  # generation of the first item written (a restore starts past 0)

    @property
    def tiers(self) -> list[Tier]:
        """The tier (one)."""
        return [self.tier]

    @property
    def write_pos(self) -> int:
        """The slot the next item goes to."""
        return self.written % self.capacity

    # ------------------------------------------------------------------ writes

    def commit(self, n: int) -> None:
        """Count ``n`` items already written at the write position."""
        self.written += n
        self.size = min(self.capacity, self.size + n)

    def append(self, records: torch.Tensor) -> None:
        """Write records in order; if more than the capacity arrive, only the newest are kept."""
        n = records.shape[0]
        if n == 0:
            return
        skip = max(0, n - self.capacity)
        if skip:
            self.written += skip
            records = records[skip:]
            n = records.shape[0]
        pos = self.write_pos
        first = min(n, self.capacity - pos)
        self.tier.write(pos, records[:first])
        if first < n:
            self.tier.write(0, records[first:])
        self.commit(n)

    def reserve(self, ahead: int, n: int) -> tuple[int, list[torch.Tensor]]:
        """Slots for ``n`` items written ``ahead`` past the write position (they count once
        committed); the ring wraps (two views), and of more than ``capacity`` items only the
        newest ``capacity`` get rows, as if written in order."""
        cap = self.capacity
        keep = min(n, cap)
        start = (self.written + ahead + n - keep) % cap
        first = min(keep, cap - start)
        views = [self.tier.region(start, start + first)]
        if first < keep:
            views.append(self.tier.region(0, keep - first))
        return n - keep, views

    def overwrites_live(self, ahead: int, n: int) -> bool:
        """Whether ``n`` items ``ahead`` past the write position reach live items' slots."""
        return self.size + ahead + n > self.capacity

    def receive(self, n: int) -> torch.Tensor | None:
        """The next ``n`` slots as one view, if they do not wrap (else ``None``: append)."""
        pos = self.write_pos
        if n > self.capacity or pos + n > self.capacity:
            return None
        return self.tier.region(pos, pos + n)

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
        self.taken += n
        self.retracted += n

    # ------------------------------------------------------------------ reads

    def gather(self, generations: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the items ``generations`` into ``out`` (slot ``g % capacity``)."""
        oldest = self.written - self.size
        self.tier.gather(generations, out, base=oldest - oldest % self.capacity)

    def locate(self, generations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tier, slot)``: tier 0, slot ``g % capacity``."""
        return torch.zeros_like(generations), generations % self.capacity

    # ------------------------------------------------------------------ state

    def stats(self) -> dict[str, object]:
        """Items and bytes in the tier (one tier: nothing is demoted; overwrites are evictions)."""
        evictions = self.written - self.base + self.retracted - self.size - self.taken
        return {
            "tiers": [tier_stats(self.tier, self.size)],
            "demotions": 0,
            "evictions": evictions,
            "taken": self.taken,
            "demotion_wait_ms": 0.0,
        }

    def close(self) -> None:
        """Release the tier."""
        self.tier.close()

    def reset(self, base: int) -> None:
        """Empty the shard; the next item written gets generation ``base`` (a restore)."""
        self.written, self.size, self.taken, self.retracted, self.base = base, 0, 0, 0, base

    def state_dict(self) -> dict[str, object]:
        """Size, counters and a copy of the tier's contents (:meth:`Tier.state_dict`)."""
        return {
            "size": self.size,
            "written": self.written,
            "taken": self.taken,
            "retracted": self.retracted,
            "base": self.base,
            "tier": self.tier.state_dict(),
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore a shard saved by :meth:`state_dict` with the same capacity and record size.

        Raises:
            ConfigError: on a size outside ``0..capacity``.
        """
        if not 0 <= int(state["size"]) <= self.capacity:
            raise ConfigError(f"shard size: expected 0..{self.capacity}, got {state['size']}")
        self.tier.load_state_dict(state["tier"])
        self.size, self.written = int(state["size"]), int(state["written"])
        self.taken, self.retracted = int(state["taken"]), int(state["retracted"])
        self.base = int(state["base"])
