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

On CUDA the demoter thread runs on the tiers' device (set when it starts) and issues its copies on
a stream of its own: that stream first waits for the stream of the round that handed it the work,
and every later reader or writer of the tiers (``settle``, ``reserve``) makes its current stream
wait for an event recorded after the demoter's copies (``tiers/cuda.py``). Copies into a host
tier are synchronous on the demoter's stream, so the host never reads a row still in flight.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from conduit_dist.errors import ConfigError
from conduit_dist.threads import executor
from conduit_dist.tiers.base import Storage, Tier, tier_stats
from conduit_dist.tiers.cuda import WorkerStream, cuda_device, upload


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


class TieredShard(Storage):
    """One rank's shard over ``tiers`` (fastest first).

    Args:
        tiers: the tiers, fastest first (e.g. host memory, then disk).
        background: demote ahead on a worker thread between rounds (see the module docstring);
            ``False`` demotes inside the round that needs the room.

    Raises:
        ConfigError: on no tiers, tiers of different record sizes, or CUDA tiers on different
            devices.
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
        # the tiers' CUDA device (None: all in host memory), resolved once
        self.device = cuda_device(t.data.device for t in tiers)
        self._order = WorkerStream(self.device if self.demotes_ahead else None)
        self._worker = (
            executor("conduit-demote", self._order.device) if self.demotes_ahead else None
        )
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
        self._order.hand_over()  # CUDA: after what this thread's stream wrote into tier 0
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
        """On the demoter thread: make room, with CUDA copies on the demoter's own stream."""
        with self._order.use(), self._lock:
            self._make_room(0, min(n, self.rings[0].cap))
            # under the lock: whoever sees the slots freed also sees the event after the copies
            # that read them (no host wait: a copy into a host tier was synchronous already)
            self._order.finished()

    def settle(self) -> None:
        """Wait for the background demotion, if any (re-raising its error); on CUDA the
        caller's current stream then waits for the demoter's copies (on the device)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            t0 = time.perf_counter()
            ahead.result()
            self.demotion_wait_ms += (time.perf_counter() - t0) * 1e3
        self._order.join()  # also when another thread took the result: each stream waits

    # ------------------------------------------------------------------ writes

    def _make_room(self, k: int, n: int) -> None:
        """Free ``n`` slots in tier ``k``: demote its oldest (the last tier evicts them)."""
        ring = self.rings[k]
        excess = ring.size + n - ring.cap
        if excess <= 0:
            return
        if k + 1 < len(self.rings):
            data = ring.tier.data
            # the index is built on the tier's own device (a CPU index into a CUDA tier fails);
            # index_select copies the oldest rows out, so the next tier's copy never reads
            # slots that this tier is about to reuse
            idx = torch.arange(ring.start, ring.start + excess, device=data.device)
            self._push(k + 1, data.index_select(0, idx.remainder_(ring.cap)))
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

    def receive(self, n: int) -> torch.Tensor | None:
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
        """Account for ``n`` items received into the rows from :meth:`receive`."""
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

    def reserve(self, ahead: int, n: int) -> tuple[int, list[torch.Tensor]] | None:
        """Free tier-0 slots for ``n`` items ``ahead`` past the newest, or ``None`` when tier 0
        has fewer free slots (items would first have to be demoted: the caller stages them).
        A background demotion only frees more slots, so the rows stay valid until the commit."""
        ring = self.rings[0]
        with self._lock:
            free = ring.cap - ring.size
            if ahead + n > free:
                return None
            start = (ring.end() + ahead) % ring.cap
        self._order.join()  # CUDA: slots a running demotion freed are written after its copies
        first = min(n, ring.cap - start)
        views = [ring.tier.region(start, start + first)]
        if first < n:
            views.append(ring.tier.region(0, n - first))
        return 0, views

    def overwrites_live(self, ahead: int, n: int) -> bool:
        """Never: :meth:`reserve` gives free slots only."""
        return False

    # ------------------------------------------------------------------ reads

    def _spans(self) -> list[tuple[_Ring, int, int]]:
        """``(ring, first generation, end generation)`` of every non-empty tier."""
        out, end = [], self.written
        for ring in self.rings:  # newest tier first
            if ring.size:
                out.append((ring, end - ring.size, end))
            end -= ring.size
        return out

    def gather(self, generations: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the live items ``generations`` (whichever tier holds each) into ``out``.

        Args:
            generations: int64 generations of live items, on the host (the contract) or on
                ``out``'s device.
            out: ``uint8 [n, record_bytes]`` on any device, any strides; when it is in host
                memory its rows are readable on the host when this returns (``Tier.gather``).
        """
        self.settle()
        spans = self._spans()
        if len(spans) == 1:  # one tier holds every live item: no scatter needed
            ring, lo, _ = spans[0]
            ring.tier.gather((generations - lo + ring.start) % ring.cap, out)
            return
        for ring, lo, hi in spans:
            mask = (generations >= lo) & (generations < hi)
            pos = mask.nonzero().squeeze(1)
            if pos.numel():
                phys = (generations[pos] - lo + ring.start) % ring.cap
                rows = torch.empty((pos.numel(), out.shape[1]), dtype=out.dtype, device=out.device)
                ring.tier.gather(phys, rows)  # across devices; into host memory: landed
                out.index_copy_(0, upload(pos, out.device), rows)

    @property
    def tiers(self) -> list[Tier]:
        """The tiers, fastest first."""
        return [r.tier for r in self.rings]

    def locate(self, generations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tier, slot)`` int64 tensors: where the live items ``generations`` are stored
        (after :meth:`settle`)."""
        tier, slot = torch.empty_like(generations), torch.empty_like(generations)
        for k, ring in enumerate(self.rings):
            lo = self.written - sum(r.size for r in self.rings[: k + 1])
            mask = (generations >= lo) & (generations < lo + ring.size)
            tier[mask] = k
            slot[mask] = (generations[mask] - lo + ring.start) % ring.cap
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
        return {
            "tiers": [tier_stats(r.tier, r.size) for r in self.rings],
            "demotions": self.demotions,
            "evictions": self.evictions,
            "taken": self.taken,
            "demotion_wait_ms": self.demotion_wait_ms,
        }

    def state_dict(self) -> dict[str, object]:
        """Ring positions, counters and a copy of every tier's contents
        (:meth:`Tier.state_dict`)."""
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
