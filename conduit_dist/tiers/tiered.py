"""A shard spanning several tiers, newest items in the fastest: demotion, eviction, exact sampling.

Items keep FIFO order across tiers: every item in tier ``k + 1`` is older than every item in tier
``k``. New items enter tier 0; when it is full its oldest items are *demoted* (copied) to tier 1,
and so on; the last tier *evicts* its oldest. No tier ever holds more than its slots. Sampling
addresses items logically (``0 .. size-1``, newest tier first) and maps them to physical slots,
so a uniform draw over logical indices is uniform over every item whichever tier holds it.

Demotion runs in the background: after a round, :meth:`demote_ahead` makes room in tier 0 for as
many items as that round brought, on a worker thread, while the learner computes; the next round
first calls :meth:`settle` (waits for it; the wait is counted as ``demotion_wait_ms``). When the
shard is full this evicts the oldest items of the last tier one round early, exactly
``max(0, size + n - capacity)`` of them, so every rank can replicate the shard's size; between
rounds the store then holds ``capacity - n`` items, and ``capacity`` again when the next round's
items arrive (before it samples). Rounds never overlap a demotion.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from conduit_dist.errors import ConfigError
from conduit_dist.tiers.base import Tier


@dataclass
class _Ring:
    tier: Tier
    start: int = 0  # physical slot of the oldest item
    size: int = 0

    @property
    def cap(self) -> int:
        return self.tier.slots

    def end(self) -> int:
        return (self.start + self.size) % self.cap


class TieredShard:
    """One rank's shard over ``tiers`` (fastest first).

    Args:
        tiers: the tiers, fastest first (e.g. host memory, then disk).
        background: demote ahead on a worker thread between rounds (see the module docstring);
            ``False`` demotes inside the round that needs the room.

    Raises:
        ConfigError: on no tiers, or tiers of different record sizes.
    """

    def __init__(self, tiers: list[Tier], background: bool = True) -> None:
        if not tiers:
            raise ConfigError("tiers: expected at least one tier, got none")
        sizes = {t.record_bytes for t in tiers}
        if len(sizes) != 1:
            raise ConfigError(f"tiers: expected one record size, got {sorted(sizes)}")
        self.rings = [_Ring(t) for t in tiers]
        self.capacity = sum(t.slots for t in tiers)
        self.written = 0
        self.demotions = 0
        self.evictions = 0
        self.taken = 0  # items a queue took out
        self.demotes_ahead = background and len(tiers) > 1
        self.ahead_limit = self.rings[0].cap  # room made ahead: at most all of tier 0
        self.demotion_wait_ms = 0.0
        self._worker = ThreadPoolExecutor(1, "conduit-demote") if self.demotes_ahead else None
        self._ahead: Future | None = None
        # held while the rings change (a round's writes, a background demotion): stats read under
        # it from any thread and so never see a ring halfway through a change
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        """Items held over all tiers."""
        return sum(r.size for r in self.rings)

    # ------------------------------------------------------------------ background demotion

    def demote_ahead(self, n: int) -> None:
        """Start making room in tier 0 for ``n`` items on the worker thread (after a round)."""
        if self._worker is None or n <= 0:
            return
        self.settle()
        self._ahead = self._worker.submit(self._room_for, n)

    def ahead_evictions(self, sizes: np.ndarray, inflow: np.ndarray) -> np.ndarray | None:
        """Items every shard's demoter evicts before the next round, from replicated inputs.

        Each rank's :meth:`demote_ahead` makes room for as many items as its shard received
        this round, evicting ``max(0, size + n - capacity)`` once full; tier config is the same on
        every rank, so every rank can update every shard's size without an exchange.

        Args:
            sizes: ``[world]`` items on each shard after this round.
            inflow: ``[world]`` items each shard received this round.

        Returns:
            ``int64 [world]`` to subtract from ``sizes``, or ``None`` when nothing runs ahead.
        """
        if not self.demotes_ahead:
            return None
        ahead = np.minimum(inflow, self.ahead_limit)
        return np.maximum(0, sizes + ahead - self.capacity)

    def _room_for(self, n: int) -> None:
        with self._lock:
            self._make_room(0, min(n, self.rings[0].cap))
            for ring in self.rings:
                if ring.tier.data.device.type == "cuda":  # copies done before a round reads them
                    torch.cuda.synchronize(ring.tier.data.device)

    def settle(self) -> None:
        """Wait for the background demotion, if any (re-raising its error)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            t0 = time.perf_counter()
            ahead.result()
            self.demotion_wait_ms += (time.perf_counter() - t0) * 1e3

    # ------------------------------------------------------------------ writes

    def _make_room(self, k: int, n: int) -> None:
        """Free ``n`` slots in tier ``k``: demote its oldest (the last tier evicts them)."""
        ring = self.rings[k]
        excess = ring.size + n - ring.cap
        if excess <= 0:
            return
        if k + 1 < len(self.rings):
            idx = (ring.start + torch.arange(excess)) % ring.cap
            oldest = ring.tier.data.index_select(0, idx)
            self._push(k + 1, oldest)
            self.demotions += excess
        else:
            self.evictions += excess
        ring.start = (ring.start + excess) % ring.cap
        ring.size -= excess

    def _push(self, k: int, records: torch.Tensor) -> None:
        ring = self.rings[k]
        for a in range(0, records.shape[0], ring.cap):  # chunks that fit the tier
            chunk = records[a : a + ring.cap]
            n = chunk.shape[0]
            self._make_room(k, n)
            pos = ring.end()
            first = min(n, ring.cap - pos)
            ring.tier.write(pos, chunk[:first])
            if first < n:
                ring.tier.write(0, chunk[first:])
            ring.size += n

    def append(self, records: torch.Tensor) -> None:
        """Add records (oldest first); older items move down the tiers to make room."""
        self.settle()
        with self._lock:
            self._append(records)

    def _append(self, records: torch.Tensor) -> None:
        self.written += records.shape[0]  # skipped items count: generations stay FIFO order
        if records.shape[0] > self.capacity:
            self.evictions += records.shape[0] - self.capacity
            records = records[-self.capacity :]
        self._push(0, records)

    def receive_region(self, n: int) -> torch.Tensor | None:
        """Contiguous tier-0 slots for the next ``n`` items (after making room), or ``None``."""
        self.settle()
        ring = self.rings[0]
        if n > ring.cap:
            return None
        with self._lock:
            self._make_room(0, n)
        pos = ring.end()
        if pos + n > ring.cap:
            return None
        return ring.tier.region(pos, pos + n)

    def commit(self, n: int) -> None:
        """Account for ``n`` items received into the region from :meth:`receive_region`."""
        with self._lock:
            self.rings[0].size += n
            self.written += n

    def take_oldest(self, n: int) -> None:
        """Remove the ``n`` oldest items (a queue delivered them), from the last tier up."""
        self.settle()
        if not 0 <= n <= self.size:
            raise ValueError(f"take_oldest: expected 0..{self.size} items, got {n}")
        with self._lock:
            for ring in reversed(self.rings):
                k = min(n, ring.size)
                ring.start = (ring.start + k) % ring.cap
                ring.size -= k
                self.taken += k
                n -= k

    def take_newest(self, n: int) -> None:
        """Remove the ``n`` newest items (a LIFO delivered them), from the first tier down."""
        self.settle()
        if not 0 <= n <= self.size:
            raise ValueError(f"take_newest: expected 0..{self.size} items, got {n}")
        with self._lock:
            for ring in self.rings:
                k = min(n, ring.size)
                ring.size -= k
                self.written -= k
                self.taken += k
                n -= k

    direct_views = None  # writing ahead of a round across tiers would need a demotion

    # ------------------------------------------------------------------ reads

    @property
    def oldest(self) -> int:
        """Generation of the oldest live item (live items: ``oldest .. written - 1``, FIFO
        across tiers)."""
        return self.written - self.size

    def _tier_spans(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per non-empty tier, oldest first: first age position (0: the oldest item), first
        logical index, and items held."""
        newer = np.array([r.size for r in self.rings], dtype=np.int64)  # newest tier first
        logical = np.concatenate([[0], np.cumsum(newer)[:-1]])[::-1].copy()
        sizes = newer[::-1].copy()  # oldest tier first
        ages = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        keep = sizes > 0
        return (
            torch.from_numpy(ages[keep]),
            torch.from_numpy(logical[keep]),
            torch.from_numpy(sizes[keep]),
        )

    def live(self, index: torch.Tensor) -> torch.Tensor:
        """Gather indices of the live items at positions ``index`` in ``[0, size)``: logical
        indices already are."""
        return index

    def index_of(self, generations: torch.Tensor) -> torch.Tensor:
        """Logical gather indices of live items by generation (valid until items arrive)."""
        age = generations - self.oldest
        ages, logical, _ = self._tier_spans()
        tier = torch.searchsorted(ages, age, right=True) - 1
        return age - ages[tier] + logical[tier]

    def generations(self, index: torch.Tensor) -> torch.Tensor:
        """Generations of the live items at logical indices (inverse of :meth:`index_of`)."""
        ages, logical, _ = self._tier_spans()
        order = torch.argsort(logical)  # tiers by logical start
        lo = logical[order]
        k = order[torch.searchsorted(lo, index, right=True) - 1]
        return self.oldest + index - logical[k] + ages[k]

    def leaf_of(self, index: torch.Tensor) -> torch.Tensor:
        """``generation % capacity`` of the items at logical indices."""
        return self.generations(index) % self.capacity

    def index_of_leaf(self, leaf: torch.Tensor, generation: torch.Tensor) -> torch.Tensor:
        """Logical indices of the items at leaves ``leaf`` (generations ``generation[leaf]``)."""
        return self.index_of(generation[leaf])

    def gather(self, logical: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the items at logical indices (newest tier first) into ``out``."""
        self.settle()
        offset = 0
        for ring in self.rings:
            if ring.size == 0:
                continue
            mask = (logical >= offset) & (logical < offset + ring.size)
            pos = mask.nonzero().squeeze(1)
            if pos.numel():
                phys = (logical[pos] - offset + ring.start) % ring.cap
                rows = torch.empty(
                    (pos.numel(), out.shape[1]), dtype=out.dtype, device=ring.tier.data.device
                )
                ring.tier.gather(phys, rows)
                # a device tier read into host memory must finish before index_copy_ reads it
                to_host = out.device.type == "cpu"
                rows = rows.to(out.device, non_blocking=not to_host)
                out.index_copy_(0, pos.to(out.device), rows)
            offset += ring.size

    @property
    def tiers(self) -> list[Tier]:
        """The tiers, fastest first."""
        return [r.tier for r in self.rings]

    def locate(self, generations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tier, slot)`` int64 tensors: where the live items ``generations`` are stored
        (after :meth:`settle`)."""
        logical = self.index_of(generations)
        tier, slot = torch.empty_like(logical), torch.empty_like(logical)
        offset = 0
        for k, ring in enumerate(self.rings):
            mask = (logical >= offset) & (logical < offset + ring.size)
            tier[mask] = k
            slot[mask] = (logical[mask] - offset + ring.start) % ring.cap
            offset += ring.size
        return tier, slot

    def reset(self, base: int) -> None:
        """Empty every tier; the next item written gets generation ``base`` (a restore)."""
        self.settle()
        with self._lock:
            for ring in self.rings:
                ring.start = ring.size = 0
            self.written, self.taken = base, 0

    def stats(self) -> dict[str, object]:
        """Items and bytes per tier, demotions and evictions so far.

        Safe from any thread at any time: it reads under the lock every change to the rings
        holds, and never waits for (or takes over) the background demotion, which is the round
        thread's to settle.
        """
        with self._lock:
            return self._stats()

    def _stats(self) -> dict[str, object]:
        tiers = [
            {
                "kind": r.tier.kind,
                "items": r.size,
                "bytes": r.size * r.tier.record_bytes,
                "capacity_bytes": r.tier.capacity_bytes,
                "read_gbps": r.tier.read_gbps,
                "write_gbps": r.tier.write_gbps,
                "bandwidth_source": r.tier.bandwidth_source,
            }
            for r in self.rings
        ]
        return {
            "tiers": tiers,
            "demotions": self.demotions,
            "evictions": self.evictions,
            "taken": self.taken,
            "demotion_wait_ms": self.demotion_wait_ms,
        }

    def state_dict(self) -> dict[str, object]:
        """Ring positions, counters and every tier's contents."""
        self.settle()
        return {
            "rings": [
                {"start": r.start, "size": r.size, "tier": r.tier.state_dict()} for r in self.rings
            ],
            "written": self.written,
            "demotions": self.demotions,
            "evictions": self.evictions,
            "taken": self.taken,
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore from :meth:`state_dict` (same tiers and sizes)."""
        self.settle()
        if len(state["rings"]) != len(self.rings):
            raise ConfigError(
                f"tiers: checkpoint has {len(state['rings'])}, shard has {len(self.rings)}"
            )
        for ring, saved in zip(self.rings, state["rings"]):
            ring.tier.load_state_dict(saved["tier"])
            ring.start, ring.size = int(saved["start"]), int(saved["size"])
        self.written = int(state["written"])
        self.demotions, self.evictions = int(state["demotions"]), int(state["evictions"])
        self.taken = int(state.get("taken", 0))

    def close(self) -> None:
        """Finish any demotion, stop the worker, close every tier (disk files are removed)."""
        try:
            self.settle()
        finally:
            if self._worker is not None:
                self._worker.shutdown()
        for ring in self.rings:
            ring.tier.close()
