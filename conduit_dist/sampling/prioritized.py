"""Prioritized replay, exact over the global (sharded) store.

Every shard keeps a sum tree (and a min tree) over its slots, keyed by ``generation % capacity``
so an item's priority follows it whichever tier holds it. An item ``i`` has mass
``m_i = (p_i + eps) ** alpha``; a learner's batch of ``b`` items is split over shards by a
multinomial with probabilities ``M_s / M`` (each shard's total mass travels in the round's meta
exchange; the split's draws come from a stream keyed by ``(seed, round, learner)``, so every
rank computes the same split with no further exchange), and each shard draws
its share i.i.d. in proportion to ``m_i`` from its tree: item ``i`` is drawn with probability
``m_i / M`` whichever shard holds it, i.i.d. across the batch.

Delivered beside the fields: ``"_index"`` (int64: ``rank << 48 | generation``, an opaque
address) and ``"_weight"`` (float32), ``(N P(i)) ** -beta / (N P_min) ** -beta``, which equals
``(m_i / m_min) ** -beta`` with ``m_min`` the smallest mass over the global store (the
shards' minima also travel in the meta exchange).

``DataPlane.update_priorities`` queues ``(index, priority)`` on the learner; each queued update
travels to its owner inside a later round's exchange (a learner may send a shard as many updates
per round as it drew from it in the round before, the usual loop of one update per sampled item;
more wait for the next round). The owner applies them at the start of its next round, after
this round's draws: an update whose slot now holds another generation (the item was
overwritten or evicted) is dropped and counted, never applied to the new item. New items enter
with the largest priority set so far over the global store (every shard's maximum travels in the
meta exchange; a shard's own updates count at once, others' one round later).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from conduit_dist.errors import ConfigError
from conduit_dist.records.spec import _native
from conduit_dist.sampling.base import OWN_KEY, Sampler, proportional, splitmix_uniform
from conduit_dist.sampling.sequences import Episodes, Sequence
from conduit_dist.sampling.sumtree import SumTree
from conduit_dist.sampling.updates import RANK_SHIFT, UpdateQueue

_KEY = 1 << 41  # allocation streams: (seed, round, _KEY + learner)


def _bits(x: float) -> int:
    """A float64's bit pattern as an int64 (the meta exchange carries int64)."""
    return int(np.float64(x).view(np.int64))


class Prioritized(Sampler):
    """Each learner's batch i.i.d. with probability ``(p_i + eps)^alpha / sum``, over every shard.

    Args:
        alpha: priority exponent (0: uniform).
        beta: importance-weight exponent (may be changed between fetches, e.g. annealed to 1).
        eps: added to every priority (keeps items with a zero TD error sampleable).
        initial_priority: the largest priority before any update (what the first items get).

    Raises:
        ConfigError: on a negative ``alpha``, ``beta`` outside ``[0, 1]``, a negative ``eps``,
            or a non-positive ``initial_priority``.
    """

    name = "prioritized"
    speculative = True  # i.i.d. draws from the tree, the split from the masses in the meta
    meta_width = 3  # total mass, smallest positive mass, largest priority (float64 bits)
    trailer_bytes = 16  # int64 generation, float64 mass per delivered row
    routes_updates = True

    def __init__(
        self,
        alpha: float = 0.6,
        beta: float = 0.4,
        eps: float = 1e-6,
        initial_priority: float = 1.0,
        sequence: Sequence | None = None,
    ) -> None:
        super().__init__()
        if sequence is not None and not isinstance(sequence, Sequence):
            raise ConfigError(
                f"sampler.sequence: expected a conduit_dist.Sequence, got {type(sequence).__name__}"
            )
        if sequence is not None and sequence.window == 1:
            raise ConfigError(
                "sampler.sequence: length=1 with n_step=1 draws single items; pass sequence=None"
            )
        self.sequence = sequence
        self.windowed = sequence is not None
        self.routes_updates = alpha > 0  # with alpha = 0 every mass is 1: nothing to update
        self.episodes: Episodes | None = None
        for field, value, ok, want in (
            ("alpha", alpha, alpha >= 0, ">= 0"),
            ("beta", beta, 0 <= beta <= 1, "in [0, 1]"),
            ("eps", eps, eps >= 0, ">= 0"),
            ("initial_priority", initial_priority, initial_priority > 0, "> 0"),
        ):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and ok):
                raise ConfigError(f"sampler.{field}: expected a number {want}, got {value!r}")
        self.alpha, self.beta, self.eps = float(alpha), float(beta), float(eps)
        self.max_priority = float(initial_priority)  # over the global store, as known here
        self.global_min = math.inf  # smallest mass over the global store, latest round
        self.tree: SumTree | None = None
        self.updates: UpdateQueue | None = None  # built at bind (it needs the world)
        self.applied = self.dropped = 0

    def bind(self, ctx) -> None:
        """Attach to a plane (and make the update queue for its world)."""
        super().bind(ctx)
        self.updates = UpdateQueue(ctx.rank, ctx.world)

    def layout(self, spec) -> tuple[object, int]:
        """Items: stored with a 16-byte trailer, delivered as stored. Windows: stored as put,
        delivered as ``Sequence.wire_bytes`` rows."""
        if self.sequence is None:
            return super().layout(spec)
        return spec, self.sequence.wire_bytes(spec.record_bytes)

    def attach(self, shard, spec) -> None:
        """Track ``shard``'s items (rows of ``spec``)."""
        self.shard = shard
        seq = self.sequence
        if seq is None:
            self._col = spec.trailer // 8  # the trailer after the fields, in storage
        else:
            self._col = seq.trailer_at(spec.record_bytes) // 8
        cap = shard.capacity
        self.tree = SumTree(cap)
        self._gen = torch.full((cap,), -1, dtype=torch.int64)  # generation in each tree leaf
        if seq is not None:
            self.episodes = Episodes(seq, spec, shard, self._gen)
        self._lo = self._hi = 0  # live generations the tree holds: [lo, hi)
        self._draw = torch.empty(256, dtype=torch.int64)
        self._mass = torch.empty(256, dtype=torch.float64)

    def mass(self, priority: torch.Tensor) -> torch.Tensor:
        """``(priority + eps) ** alpha`` in float64."""
        return (priority.to(torch.float64) + self.eps).pow_(self.alpha)

    # ------------------------------------------------------------------ the shard's side

    def _sync(self) -> None:
        """Zero the leaves of items gone since the last call, give new items the max priority."""
        sh, cap = self.shard, self.shard.capacity
        written, oldest = sh.written, sh.oldest
        # gone and not reused by a newer item (whose write below sets the leaf)
        gone_lo, gone_hi = max(self._lo, written - cap), min(oldest, self._hi)
        if gone_hi > gone_lo:
            leaf = torch.arange(gone_lo, gone_hi) % cap
            self.tree.set(leaf, torch.zeros(leaf.numel(), dtype=torch.float64))
            self._gen[leaf] = -1
        new_lo = max(self._hi, oldest)
        if written > new_lo:
            gens = torch.arange(new_lo, written)
            leaf = gens % cap
            top = self.mass(torch.tensor([self.max_priority], dtype=torch.float64))
            self._gen[leaf] = gens
            if self.episodes is None:  # every item is a start
                self.tree.set(leaf, top.expand(leaf.numel()))
            else:  # a start once its window is in
                self.tree.set(leaf, torch.zeros(leaf.numel(), dtype=torch.float64))
                starts = self.episodes.ingest(gens)
                self.tree.set(starts % cap, top.expand(starts.numel()))
        self._lo, self._hi = oldest, written

    def _apply(self) -> None:
        """Apply the updates received for this shard (stale generations are dropped)."""
        upd = self.updates.take_own()
        if upd is None:
            return
        if _native is not None:  # one C loop: check, mass, leaf and ancestors per update
            upd = upd.contiguous()
            t = self.tree
            n_live, top = _native.tree_update(
                t.sum.data_ptr(), t.min.data_ptr(), t.offs.data_ptr(), t.H, self._gen.data_ptr(),
                self.shard.capacity, self._lo, upd.data_ptr(), upd.shape[0], self.alpha,
                self.eps,
            )  # fmt: skip
            self.applied += n_live
            self.dropped += upd.shape[0] - n_live
            self.max_priority = max(self.max_priority, top)
            return
        gens, prio = upd[:, 0], upd[:, 1].view(torch.float64)
        leaf = gens % self.shard.capacity
        live = (self._gen[leaf] == gens) & (gens >= self._lo)
        n_live = int(live.sum())
        self.dropped += gens.numel() - n_live
        self.applied += n_live
        if n_live:
            self.tree.set(leaf[live], self.mass(prio[live]))
            self.max_priority = max(self.max_priority, float(prio[live].max()))

    def local_meta(self, shard: object) -> tuple[int, int, int]:
        """After this round's items are in: sync the tree, apply received updates, and report
        the shard's total mass, smallest mass and largest priority (as float64 bits)."""
        self._sync()
        self._apply()
        return (_bits(self.tree.total), _bits(self.tree.smallest), _bits(self.max_priority))

    def drawable(self) -> bool:
        """Only with a positive mass (a shard of zero mass is allocated nothing)."""
        return self.tree.total > 0

    def draw(self, count: int, size: int, round: int, stream: int = 0) -> torch.Tensor:
        """``count`` gather indices drawn in proportion to mass (valid until the next draw;
        ``stream`` as in ``Sampler.draw``)."""
        if self._draw.shape[0] < count:
            self._draw = torch.empty(max(count, 2 * self._draw.shape[0]), dtype=torch.int64)
            self._mass = torch.empty(self._draw.shape[0], dtype=torch.float64)
        leaf = self._draw[:count]
        key = self.ctx.rank + stream * OWN_KEY
        self.tree.sample(count, self.ctx.seed, round, key, leaf, self._mass)
        return self.shard.index_of_leaf(leaf, self._gen)

    def tag(self, index: torch.Tensor, out: torch.Tensor) -> None:
        """Write each gathered row's address and mass into its trailer."""
        if index.numel() == 0:
            return
        leaf = self.shard.leaf_of(index)
        if _native is not None and out.stride(0) == out.shape[1] and out.stride(1) == 1:
            leaf = leaf.contiguous()
            _native.tag_rows(
                out.data_ptr(), out.shape[1], out.shape[0], self._col * 8, leaf.data_ptr(),
                self._gen.data_ptr(), self.tree.sum.data_ptr(), self.ctx.rank << RANK_SHIFT,
            )  # fmt: skip
            return
        cols, at = out.view(torch.int64), self._col  # rows are 8-byte multiples
        cols[:, at] = self._gen[leaf] | (self.ctx.rank << RANK_SHIFT)
        cols[:, at + 1] = self.tree.sum[leaf].view(torch.int64)

    # ------------------------------------------------------------------ the allocation

    def allocate(
        self, requests: np.ndarray, sizes: np.ndarray, round: int, meta: np.ndarray
    ) -> np.ndarray:
        """Per-learner multinomial split over shards in proportion to their masses."""
        world = sizes.shape[0]
        vals = np.ascontiguousarray(meta[:, :3]).view(np.float64)
        masses, mins, tops = vals[:, 0], vals[:, 1], vals[:, 2]
        self.global_min = float(mins.min())
        self.max_priority = max(self.max_priority, float(tops.max()))
        counts = np.zeros((world, world), dtype=np.int64)
        total = float(masses.sum())
        if not total > 0 or not requests.any():
            return counts
        if world == 1:
            counts[0, 0] = requests[0]
            return counts
        cum = np.cumsum(masses)
        if _native is not None:  # every learner in one call
            req = np.ascontiguousarray(requests, dtype=np.int64)
            _native.mass_alloc(
                counts.ctypes.data, world, cum.ctypes.data, req.ctypes.data, self.ctx.seed,
                round, _KEY,
            )  # fmt: skip
            return counts
        for learner in np.nonzero(requests)[0]:  # the same stream without the extension
            n, key = int(requests[learner]), _KEY + int(learner)
            z = np.array(splitmix_uniform(n, 1 << 53, self.ctx.seed, round, key), dtype=np.float64)
            u = z * 2.0**-53 * cum[-1]
            shard = np.minimum(np.searchsorted(cum, u, side="right"), world - 1)
            for i in np.nonzero(masses[shard] == 0)[0]:  # u rounded up to the total
                while shard[i] > 0 and cum[shard[i]] == cum[shard[i] - 1]:
                    shard[i] -= 1
            counts[learner] = np.bincount(shard, minlength=world)
        return counts

    def shares(self, sizes: np.ndarray, meta: np.ndarray) -> np.ndarray:
        """Each shard's mass over the total (from the round's meta)."""
        masses = np.ascontiguousarray(meta[:, 0]).view(np.float64)
        total = masses.sum()
        return masses / total if total > 0 else np.zeros(sizes.shape[0])

    def expected(self, requests: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """Size-proportional (masses are not known ahead of a round)."""
        return proportional(requests, sizes)

    # ------------------------------------------------------------------ the learner's side

    def gather_windows(self, index: torch.Tensor, out: torch.Tensor) -> None:
        """Delivered rows of drawn starts: their windows, n-step values, address and mass."""
        self.episodes.compose(self._gen[self.shard.leaf_of(index)], out)
        self.tag(index, out)

    def unpack(self, records: torch.Tensor) -> dict[str, torch.Tensor]:
        """Windows' fields (``[B, T, ...]`` or n-step entries) and ``_index``/``_weight``."""
        return {**self.episodes.unpack(records), **self.entries(records)}

    def entries(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """``_index`` and ``_weight`` of delivered rows from their trailers."""
        at = self._col * 8
        n = rows.shape[0]
        index = torch.empty(n, dtype=torch.int64)
        weight = torch.empty(n, dtype=torch.float32)
        if _native is not None and rows.is_cpu and rows.stride(1) == 1:
            _native.read_trailer(
                rows.data_ptr(), rows.stride(0), n, at, self.global_min, self.beta,
                index.data_ptr(), weight.data_ptr(),
            )  # fmt: skip
            return {"_index": index, "_weight": weight}
        cols = rows[:, at : at + 16].contiguous().view(torch.int64)
        index.copy_(cols[:, 0])
        mass = cols[:, 1].view(torch.float64)
        weight.copy_((mass / self.global_min).pow_(-self.beta))
        return {"_index": index, "_weight": weight}

    def queue_updates(self, index: torch.Tensor, priority: torch.Tensor) -> None:
        """Check and queue updates (see ``UpdateQueue.queue``; ``ConfigError`` on bad values,
        including priorities whose masses ``(p + eps) ** alpha`` overflow summed over the global
        store)."""
        room = 709.0 - math.log(self.shard.capacity * self.ctx.world)  # log of the largest mass
        if index.numel() and self.alpha * 709.8 >= room:  # a finite p can overflow it
            big = float(priority.max())
            if big + self.eps > 0 and math.log(big + self.eps) * self.alpha >= room:
                raise ConfigError(
                    f"update_priorities priority: (p + eps) ** alpha must be finite over the "
                    f"store's {self.shard.capacity * self.ctx.world} items; got p={big} with "
                    f"alpha={self.alpha}"
                )
        self.updates.queue(index, priority)

    def outgoing(self, budgets: dict[int, int]) -> dict[int, torch.Tensor]:
        """Up to ``budgets[peer]`` queued updates per peer, oldest first."""
        return self.updates.outgoing(budgets)

    def incoming(self, rows: torch.Tensor) -> None:
        """Updates another learner sent this shard (applied at the next round's start)."""
        self.updates.incoming(rows)

    def pending(self) -> int:
        """Updates queued here and not yet sent or applied."""
        return self.updates.pending()

    def stats(self) -> dict[str, int]:
        """Updates applied and dropped (stale: the slot holds another item now) on this shard."""
        return {"priority_updates_applied": self.applied, "priority_updates_dropped": self.dropped}

    def state_dict(self) -> dict[str, object]:
        """The trees' leaves, their generations, the largest priority (sums are derived) and
        the updates not applied yet (queued for other shards or received for this one)."""
        return {
            **self.updates.state_dict(),
            "name": self.name,
            "leaves": self.tree.leaves().clone(),
            "generations": self._gen.clone(),
            "live": torch.tensor([self._lo, self._hi]),
            "max_priority": self.max_priority,
            **({"episodes": self.episodes.state_dict()} if self.episodes is not None else {}),
        }

    def item_state(self, generations: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each live item's mass (0 for a window that cannot start yet), with the updates
        received for this shard applied first (as the next round would)."""
        self._sync()
        self._apply()
        leaf = generations % self.shard.capacity
        return {"mass": self.tree.leaves()[leaf].clone()}

    def restore_begin(self, base: int) -> None:
        """Empty the tree (and the stream links); the next item is generation ``base``."""
        cap = self.shard.capacity
        self.tree.load(torch.zeros(cap, dtype=torch.float64))
        self._gen.fill_(-1)
        self._lo = self._hi = base
        if self.episodes is not None:
            ep = self.episodes
            ep.prev.fill_(-1), ep.next.fill_(-1), ep.end.fill_(False), ep.term.fill_(False)
            ep.last = {}

    def restore_piece(self, generations: torch.Tensor, items: dict[str, torch.Tensor]) -> None:
        """Link the piece's items (not to another piece's) and give each its saved mass."""
        if self.episodes is not None:
            self.episodes.last = {}
        self._sync()
        live = generations[generations >= self.shard.oldest]
        mass = items["mass"][generations.numel() - live.numel() :]
        self.tree.set(live % self.shard.capacity, mass.to(torch.float64))

    def restore_state(self, states, exact, rank, written) -> None:
        """The largest priority over the old shards; on the same world size also this rank's
        queued updates (their addresses still hold), else those are dropped and counted (the
        items were renumbered). Items put after the restore link to no old stream's tail (the
        producers start new episodes)."""
        for s in states:
            if s.get("name") != self.name:
                raise ConfigError(
                    f"sampler: checkpoint has {s.get('name')!r}, plane has {self.name!r}"
                )
        self.max_priority = max(float(s["max_priority"]) for s in states)
        if self.episodes is not None:  # new items start new episodes: no link to old tails
            self.episodes.last = {}
        if exact:
            self.updates.load_state_dict(states[rank])
        elif rank == 0:  # each old update counted once
            self.dropped += sum(int(s["queued"].shape[0] + s["received"].shape[0]) for s in states)

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore leaves saved by :meth:`state_dict` (same capacity) and rebuild the sums.

        Raises:
            ConfigError: on another sampler's state, or leaves / generations of another shape.
        """
        super().load_state_dict(state)
        cap = self.shard.capacity
        for field in ("leaves", "generations"):
            if tuple(state[field].shape) != (cap,):
                raise ConfigError(
                    f"sampler {field}: expected [{cap}] (capacity_per_rank), got "
                    f"{list(state[field].shape)}"
                )
        if (self.episodes is None) != ("episodes" not in state):
            raise ConfigError(
                f"sampler sequence: the checkpoint {'has' if 'episodes' in state else 'has no'} "
                f"stream links, the plane {'has a' if self.episodes is not None else 'has no'} "
                "sequence"
            )
        leaves = state["leaves"]
        self.tree.load(leaves)
        self._gen.copy_(state["generations"])
        self._lo, self._hi = (int(v) for v in state["live"])
        self.max_priority = float(state["max_priority"])
        self.updates.load_state_dict(state)
        if self.episodes is not None:
            self.episodes.load_state_dict(state["episodes"])
