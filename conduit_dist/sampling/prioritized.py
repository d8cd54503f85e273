"""Prioritized replay, exact over the global (sharded) store.

Every shard keeps a sum tree (and a min tree) over its slots, keyed by ``generation % capacity``
so an item's priority follows it whichever tier holds it. An item ``i`` has mass
``m_i = (p_i + eps) ** alpha``; a learner's batch of ``b`` items is split over shards by a
multinomial with probabilities ``M_s / M`` (each shard's total mass travels in the round's meta;
the split's draws come from a stream keyed by ``(seed, round, learner)``, so every rank computes
the same split with no further exchange), and each shard draws its share i.i.d. in proportion
to ``m_i`` from its tree: item ``i`` is drawn with probability ``m_i / M`` whichever shard holds
it, i.i.d. across the batch. The masses are taken after the round's items are in, so a round
whose items arrive through a collective exchanges them once more, after ingestion.

Delivered beside the fields: ``"_index"`` (int64: ``rank << 48 | generation``, an opaque
address) and ``"_weight"`` (float32), ``(N P(i)) ** -beta / (N P_min) ** -beta``, which equals
``(m_i / m_min) ** -beta`` with ``m_min`` the smallest mass over the global store (the shards'
minima also travel in the meta).

With ``alpha > 0`` learners send priorities back (:class:`~conduit_dist.sampling.base.
RoutesFeedback`): ``DataPlane.update_priorities`` queues ``(index, priority)`` on the learner;
each update travels to its owner inside a later round's exchange (a learner may send a shard as
many updates per round as it drew from it in the round before, the usual loop of one update per
sampled item; more wait for the next round). The owner applies them at the start of its next
round: an update whose slot now holds another generation is dropped and counted, never applied
to the new item. New items enter with the largest priority set so far over the global store
(every shard's maximum travels in the meta; a shard's own updates count at once, others' one
round later). With a :class:`~conduit_dist.sampling.sequences.Windows` the sampler draws
windows (:class:`~conduit_dist.sampling.base.Streams`; ``sequences.Episodes``).

``Prioritized(...)`` builds the variant its arguments call for: priorities routed back or not
(``alpha > 0``), items or windows (``sequence``); each is a ``Prioritized``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from conduit_dist.errors import ConfigError
from conduit_dist.records.buffers import FieldPool, Prefixes
from conduit_dist.records.spec import _native
from conduit_dist.sampling.base import (
    OWN_KEY,
    KeepsItemState,
    ReportsMeta,
    Sampler,
    Speculative,
    Streams,
    WritesRows,
    proportional,
    splitmix_uniform,
)
from conduit_dist.sampling.device_rows import put_words
from conduit_dist.sampling.sequences import Windows
from conduit_dist.sampling.sumtree import SumTree
from conduit_dist.sampling.updates import RANK_SHIFT

_KEY = 1 << 41  # allocation streams: (seed, round, _KEY + learner)
TRAILER = 16  # int64 address, float64 mass per delivered item


def _bits(x: float) -> int:
    """A float64's bit pattern as an int64 (the meta carries int64)."""
    return int(np.float64(x).view(np.int64))


class Prioritized(Speculative, ReportsMeta, WritesRows, KeepsItemState, Sampler):
    """Each learner's batch i.i.d. with probability ``(p_i + eps)^alpha / sum``, over every shard.

    Args:
        alpha: priority exponent (0: uniform; then no priority updates are taken).
        beta: importance-weight exponent (may be changed between fetches, e.g. annealed to 1).
        eps: added to every priority (keeps items with a zero TD error sampleable).
        initial_priority: the largest priority before any update (what the first items get).
        sequence: draw windows (slices or n-step) instead of single items.

    Raises:
        ConfigError: on a negative ``alpha``, ``beta`` outside ``[0, 1]``, a negative ``eps``,
            a non-positive ``initial_priority``, or a ``sequence`` that is not a ``Windows``
            (or draws single items).
    """

    name = "prioritized"
    meta_width = 3  # total mass, smallest positive mass, largest priority (float64 bits)

    def __new__(cls, *args, **kwargs):
        """The variant the arguments call for (see the module docstring)."""
        if cls is Prioritized:
            from conduit_dist.sampling.variants import variant

            cls = variant(*args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        alpha: float = 0.6,
        beta: float = 0.4,
        eps: float = 1e-6,
        initial_priority: float = 1.0,
        sequence: Windows | None = None,
    ) -> None:
        super().__init__()
        if sequence is not None and not isinstance(sequence, Windows):
            raise ConfigError(
                f"sampler.sequence: expected a conduit_dist.Windows, got {type(sequence).__name__}"
            )
        if sequence is not None and sequence.window == 1:
            raise ConfigError(
                "sampler.sequence: length=1 with n_step=1 draws single items; pass sequence=None"
            )
        for field, value, ok, want in (
            ("alpha", alpha, alpha >= 0, ">= 0"),
            ("beta", beta, 0 <= beta <= 1, "in [0, 1]"),
            ("eps", eps, eps >= 0, ">= 0"),
            ("initial_priority", initial_priority, initial_priority > 0, "> 0"),
        ):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and ok):
                raise ConfigError(f"sampler.{field}: expected a number {want}, got {value!r}")
        self.sequence = sequence
        self.alpha, self.beta, self.eps = float(alpha), float(beta), float(eps)
        self.max_priority = float(initial_priority)  # over the global store, as known here
        self.global_min = math.inf  # smallest mass over the global store, latest round
        self.tree: SumTree | None = None
        self.applied = self.dropped = 0  # priority updates (routed variants)

    def layout(self, spec) -> tuple[object, int]:
        """Stored with a 16-byte trailer (written as rows are gathered), delivered as stored."""
        spec = spec.with_trailer(TRAILER)
        return spec, spec.record_bytes

    def attach(self, storage, spec) -> None:
        """Track ``storage``'s items (rows of ``spec``)."""
        super().attach(storage, spec)
        self._col = self._trailer_at(spec) // 8
        cap = storage.capacity
        self.tree = SumTree(cap)
        self._gen = torch.full((cap,), -1, dtype=torch.int64)  # generation in each tree leaf
        self._gen_np = self._gen.numpy()  # the same memory (never replaced: copy_, fill_)
        self._lo = self._hi = 0  # live generations the tree holds: [lo, hi)
        self._top: tuple[tuple, float] | None = None  # ((max_priority, alpha, eps), mass)
        self._mass = torch.empty(256, dtype=torch.float64)
        # a learner's _index and _weight, pooled (read out of the trailers of each batch)
        self._entries = FieldPool([("_index", torch.int64, ()), ("_weight", torch.float32, ())])
        self._draws = torch.empty(256, dtype=torch.int64)
        self._words = Prefixes(torch.int64, torch.device("cpu"))  # trailer words (device rows)

    def _trailer_at(self, spec) -> int:
        """Byte offset of the trailer in a delivered row."""
        return spec.trailer

    def mass(self, priority: torch.Tensor) -> torch.Tensor:
        """``(priority + eps) ** alpha`` in float64."""
        return (priority.to(torch.float64) + self.eps).pow_(self.alpha)

    # ------------------------------------------------------------------ the shard's side

    def _sync(self) -> None:
        """Zero the leaves of items gone since the last call, give new items the max priority.
        (A few dozen items a round: NumPy's small operations cost a third of torch's here.)"""
        st, cap = self.storage, self.storage.capacity
        written, oldest = st.written, st.oldest
        # gone and not reused by a newer item (whose write below sets the leaf)
        gone_lo, gone_hi = max(self._lo, written - cap), min(oldest, self._hi)
        if gone_hi > gone_lo:
            leaf = np.arange(gone_lo, gone_hi, dtype=np.int64) % cap
            self.tree.fill(torch.from_numpy(leaf), 0.0)
            self._gen_np[leaf] = -1
        new_lo = max(self._hi, oldest)
        if written > new_lo:
            gens = np.arange(new_lo, written, dtype=np.int64)
            self._gen_np[gens % cap] = gens
            self._enter(gens, self._top_mass())
        self._lo, self._hi = oldest, written

    def _top_mass(self) -> float:
        """The mass of the largest priority (recomputed only when it, ``alpha`` or ``eps``
        changed)."""
        key = (self.max_priority, self.alpha, self.eps)
        if self._top is None or self._top[0] != key:
            top = self.mass(torch.tensor([key[0]], dtype=torch.float64))
            self._top = (key, float(top[0]))
        return self._top[1]

    def _enter(self, gens: np.ndarray, top: float) -> None:
        """New items (generations ``gens``, int64) become drawable with mass ``top``."""
        self.tree.fill(torch.from_numpy(gens % self.storage.capacity), top)

    def _apply(self) -> None:
        """Apply priority updates received for this shard (routed variants)."""

    def local_meta(self) -> tuple[int, int, int]:
        """After this round's items are in: sync the tree, apply received updates, and report
        the shard's total mass, smallest mass and largest priority (as float64 bits)."""
        self._sync()
        self._apply()
        return (_bits(self.tree.total), _bits(self.tree.smallest), _bits(self.max_priority))

    def drawable(self) -> bool:
        """Only with a positive mass (a shard of zero mass is allocated nothing)."""
        return self.tree.total > 0

    def draw(self, count: int, round: int, stream: int = 0) -> torch.Tensor:
        """``count`` generations drawn in proportion to mass (valid until the next draw;
        ``stream`` as in ``Sampler.draw``)."""
        if self._draws.shape[0] < count:
            n = max(count, 2 * self._draws.shape[0])
            self._mass = torch.empty(n, dtype=torch.float64)
            self._draws = torch.empty(n, dtype=torch.int64)
        gens = self._draws[:count]
        key = self.ctx.rank + stream * OWN_KEY
        self.tree.sample(count, self.ctx.seed, round, key, gens, self._mass, labels=self._gen)
        return gens

    def write_rows(self, generations: torch.Tensor, out: torch.Tensor) -> None:
        """Gather the items (on the rows' device) and write each row's address and mass into
        its trailer."""
        self.storage.gather(generations, out)
        self._tag(generations, out)

    def _tag(self, gens: torch.Tensor, out: torch.Tensor, extra: np.ndarray | None = None) -> None:
        """Write each row's address and mass (and ``extra`` int64 words after them) into its
        trailer: natively into host rows of the host path, else as words computed on the host
        and written where the rows are (``device_rows.put_words``: one upload to a GPU)."""
        n = gens.numel()
        if n == 0:
            return
        cap, bits = self.storage.capacity, self.ctx.rank << RANK_SHIFT
        if (
            extra is None
            and _native is not None
            and out.is_cpu  # the native loop writes through raw host addresses
            and not self.ctx.device_rows
            and out.stride(0) == out.shape[1]
            and out.stride(1) == 1
        ):
            gens = gens.contiguous()
            _native.tag_rows(
                out.data_ptr(), out.shape[1], out.shape[0], self._col * 8, gens.data_ptr(), cap,
                self.tree.sum.data_ptr(), bits,
            )  # fmt: skip
            return
        g = gens.numpy() if gens.is_cpu else gens.cpu().numpy()
        width = 2 if extra is None else 2 + extra.shape[1]
        words = self._words.first(n * width).view(n, width)
        w = words.numpy()
        w[:, 0] = g | bits
        w[:, 1] = self.tree.sum.numpy()[g % cap].view(np.int64)
        if extra is not None:
            w[:, 2:] = extra
        put_words(out, self._col, words)

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

    def read_rows(self, rows: torch.Tensor, unpack) -> dict[str, torch.Tensor]:
        """The fields (``unpack``) and ``_index``/``_weight`` from the trailers."""
        return {**unpack(rows), **self.entries(rows)}

    def entries(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """``_index`` and ``_weight`` of delivered rows from their trailers."""
        at = self._col * 8
        n = rows.shape[0]
        if _native is not None and rows.is_cpu and rows.stride(1) == 1:
            out = self._entries.take(n)  # pooled: reused once the caller drops the batch
            index, weight = out["_index"], out["_weight"]
            _native.read_trailer(
                rows.data_ptr(), rows.stride(0), n, at, self.global_min, self.beta,
                index.data_ptr(), weight.data_ptr(),
            )  # fmt: skip
            return out
        # on the rows' device (a CUDA learner's batch: no copy back to the host)
        cols = rows[:, at : at + 16].contiguous().view(torch.int64)
        mass = cols[:, 1].view(torch.float64)
        weight = (mass / self.global_min).pow_(-self.beta).to(torch.float32)
        return {"_index": cols[:, 0].clone(), "_weight": weight}

    def stats(self) -> dict[str, int]:
        """Updates applied and dropped (stale: the slot holds another item now) on this shard."""
        return {"priority_updates_applied": self.applied, "priority_updates_dropped": self.dropped}

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, object]:
        """The trees' leaves, their generations and the largest priority (sums are derived)."""
        return {
            "name": self.name,
            "variant": type(self).__name__,  # routed feedback, windows: what the state holds
            "leaves": self.tree.leaves().clone(),
            "generations": self._gen.clone(),
            "live": torch.tensor([self._lo, self._hi]),
            "max_priority": self.max_priority,
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore leaves saved by :meth:`state_dict` (same capacity) and rebuild the sums.

        Raises:
            ConfigError: on another sampler's state, or leaves / generations of another shape.
        """
        self.check_state(state)
        windows = isinstance(self, Streams)
        if ("episodes" in state) != windows:
            raise ConfigError(
                f"sampler sequence: the checkpoint {'has' if 'episodes' in state else 'has no'} "
                f"stream links, the plane {'has a' if windows else 'has no'} sequence"
            )
        cap = self.storage.capacity
        for field in ("leaves", "generations"):
            if tuple(state[field].shape) != (cap,):
                raise ConfigError(
                    f"sampler {field}: expected [{cap}] (capacity_per_rank), got "
                    f"{list(state[field].shape)}"
                )
        self.tree.load(state["leaves"])
        self._gen.copy_(state["generations"])
        self._lo, self._hi = (int(v) for v in state["live"])
        self.max_priority = float(state["max_priority"])

    def check_state(self, state: dict[str, object]) -> None:
        """Refuse another sampler's state, or another variant's (``alpha > 0`` or not, windows
        or items).

        Raises:
            ConfigError: naming both.
        """
        super().check_state(state)
        got, mine = state.get("variant"), type(self).__name__
        if got != mine:
            raise ConfigError(
                f"sampler: checkpoint has a {got} (alpha > 0 routes priority updates, a sequence "
                f"draws windows), plane has a {mine}; build the plane's Prioritized as it was"
            )

    def item_state(self, generations: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each live item's mass (0 for a window that cannot start yet), with the updates
        received for this shard applied first (as the next round would)."""
        self._sync()
        self._apply()
        leaf = generations % self.storage.capacity
        return {"mass": self.tree.leaves()[leaf].clone()}

    def restore_begin(self, base: int) -> None:
        """Empty the tree; the next item is generation ``base``."""
        self.tree.load(torch.zeros(self.storage.capacity, dtype=torch.float64))
        self._gen.fill_(-1)
        self._lo = self._hi = base

    def restore_piece(self, generations: torch.Tensor, items: dict[str, torch.Tensor]) -> None:
        """Take the piece's items into the tree and give each its saved mass."""
        self._sync()
        live = generations[generations >= self.storage.oldest]
        mass = items["mass"][generations.numel() - live.numel() :]
        self.tree.set(live % self.storage.capacity, mass.to(torch.float64))

    def restore_state(self, states, exact, rank, written) -> None:
        """The largest priority over the old shards.

        Raises:
            ConfigError: on another sampler's state.
        """
        for s in states:
            if s.get("name") != self.name:
                raise ConfigError(
                    f"sampler: checkpoint has {s.get('name')!r}, plane has {self.name!r}"
                )
            self.check_state(s)
        self.max_priority = max(float(s["max_priority"]) for s in states)
