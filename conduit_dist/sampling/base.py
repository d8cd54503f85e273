"""The sampler protocol: what a round asks of a sampler, at fixed points, on every rank.

A round calls its sampler at four points:

1. ``local_meta(shard)`` before the meta exchange: ``meta_width`` int64 values this shard adds to
   it (e.g. a priority mass later; nothing for uniform sampling, whose shard sizes every rank
   already replicates).
2. ``allocate(requests, sizes, round, meta)`` after ingestion: the ``[learner, shard]`` counts of
   the round. Every rank calls it with the same inputs, so every rank gets the same counts with no
   extra round trip; a sampler reseeds its generators from ``(seed, round)`` to keep it so.
3. ``draw(count, size, round)`` on each shard: the shard-local slots of its share.
4. ``feedback(...)`` after delivery (priority updates, items taken from a queue): nothing by
   default.

``expected(requests, sizes)`` gives the mean allocation, for placement's pricing. Streams derive
from ``(seed, round, rank)``, so samplers carry no random state between rounds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from conduit_dist.records.spec import _native

_MASK = (1 << 63) - 1
OWN_KEY = 1 << 39  # draw(stream=1) streams: (seed, round, OWN_KEY + rank)


def mix(*keys: int) -> int:
    """A 63-bit seed from integer keys (splitmix64 steps), stable across processes and runs."""
    h = 0x9E3779B97F4A7C15
    for k in keys:
        h = (h ^ (k & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & _MASK


_M64 = 0xFFFFFFFFFFFFFFFF
_GOLDEN = 0x9E3779B97F4A7C15


def _step(h: int, k: int) -> int:
    h = (h ^ k) * 0xBF58476D1CE4E5B9 & _M64
    h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _M64
    return h ^ (h >> 31)


def splitmix_uniform(count: int, size: int, seed: int, round: int, key: int) -> list[int]:
    """The native ``uniform_slots`` stream in Python: ``count`` values in ``[0, size)`` keyed by
    ``(seed, round, key)``, bit for bit (for what must agree across ranks without the
    extension; ~1 us a value)."""
    h = _step(_step(_step(_GOLDEN, seed & _M64), round & _M64), key & _M64)
    out = []
    for _ in range(count):
        h = (h + _GOLDEN) & _M64
        out.append((_step(h, 0) * size) >> 64)
    return out


def proportional(requests: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """``float [learner, shard]``: each request split in proportion to the shards' sizes (the
    mean allocation of uniform sampling; all 0 on an empty store)."""
    total = sizes.sum()
    if total == 0:
        return np.zeros((sizes.shape[0], sizes.shape[0]))
    return requests[:, None] * (sizes[None, :] / total)


def seeded(gen: torch.Generator, *keys: int) -> torch.Generator:
    """Reseed ``gen`` from ``keys`` and return it."""
    gen.manual_seed(mix(*keys))
    return gen


@dataclass(frozen=True)
class SamplerContext:
    """What a plane tells its sampler when it is built (the same on every rank but ``rank``).

    Attributes:
        seed: the run seed.
        rank: this shard's rank.
        world: number of shards.
        links: ``[world, world]`` link class index (0 self, 1 host, 2 net).
    """

    seed: int
    rank: int
    world: int
    links: np.ndarray


class Sampler(ABC):
    """Decides what each learner gets; see the module docstring for when a round calls what."""

    name: str = "abstract"
    meta_width: int = 0  # int64 values local_meta adds to the round's meta exchange
    # True when a shard's draws for a learner do not depend on the allocation (i.i.d. draws,
    # an allocation from requests, sizes and meta alone): a shard may then send a learner
    # candidates before the allocation is known, and the round fuses meta and delivery
    speculative: bool = False
    # bytes the sampler writes after each delivered record (tag) and reads back at the learner
    # (entries): what it returns beside the fields, e.g. prioritized replay's _index and _weight
    trailer_bytes: int = 0
    # learners queue updates for other shards (outgoing), which rounds carry to them (incoming)
    routes_updates: bool = False

    def __init__(self) -> None:
        self.ctx: SamplerContext | None = None
        self._alloc_gen = torch.Generator()
        self._draw_gen = torch.Generator()
        self._slots = torch.empty(256, dtype=torch.int64)  # reused by the native draw
        self.shard = None  # set by attach

    def bind(self, ctx: SamplerContext) -> None:
        """Attach to a plane (called once, when the plane is built)."""
        self.ctx = ctx

    def drawable(self) -> bool:
        """Whether this shard can draw now (a non-empty shard always can by default)."""
        return True

    def shares(self, sizes: np.ndarray, meta: np.ndarray) -> np.ndarray:
        """``[world]`` each shard's probability of a draw in the round just allocated (sizes
        proportional by default; all 0 on an empty store): sizes the next one-exchange round's
        candidates."""
        total = sizes.sum()
        return sizes / total if total else np.zeros(sizes.shape[0])

    windowed: bool = False  # delivered rows are composed by gather_windows (several items)
    # all or nothing per learner, and items leave the store (queues, rollouts): see taken()
    takes: bool = False
    newest_first: bool = False  # taken() counts items at the newest end (a LIFO)

    def taken(self, counts: np.ndarray) -> np.ndarray | None:
        """``int64 [world]`` oldest items each shard gives up after this round's delivery
        (``counts``: the round's allocation; the same on every rank); ``None``: none."""
        return None

    def ingested(self, inflow: np.ndarray) -> None:  # noqa: B027 (default hook)
        """``[world]`` items each shard took in this round (general and world-size-1 rounds;
        the same on every rank)."""

    def empty_reason(self, batch_size: int, stored: int) -> str:
        """Why a learner got nothing while ``stored`` items are in the store."""
        return (
            f"nothing can be drawn yet ({stored} items stored over all shards, none a start: a "
            "sampler's windows are not complete yet, or every priority is 0)"
        )

    def layout(self, spec) -> tuple[object, int]:
        """``(stored spec, delivered row bytes)``: by default rows are delivered as stored;
        ``trailer_bytes`` widen both (``spec.with_trailer``)."""
        if self.trailer_bytes:
            spec = spec.with_trailer(self.trailer_bytes)
        return spec, spec.record_bytes

    def attach(self, shard, spec) -> None:
        """Called once the plane's shard is built, with the stored records' spec."""
        self.shard = shard

    def gather_windows(self, index: torch.Tensor, out: torch.Tensor) -> None:
        """Compose delivered rows for draws ``index`` into ``out`` (``windowed`` samplers)."""
        raise NotImplementedError

    def unpack(self, records: torch.Tensor) -> dict[str, torch.Tensor]:
        """A learner's delivered rows as fields and entries (``windowed`` samplers)."""
        raise NotImplementedError

    def tag(self, index: torch.Tensor, out: torch.Tensor) -> None:  # noqa: B027
        """Write the trailers of rows just gathered from ``index`` (when ``trailer_bytes``)."""

    def entries(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """What a learner returns beside the fields, from its rows' trailers."""
        return {}

    def outgoing(self, budgets: dict[int, int]) -> dict[int, torch.Tensor]:
        """Queued updates to send, at most ``budgets[peer]`` rows per peer (``routes_updates``)."""
        return {}

    def incoming(self, rows: torch.Tensor) -> None:  # noqa: B027
        """Updates a peer sent this shard (``routes_updates``)."""

    def stats(self) -> dict[str, int]:
        """Counters for ``store_stats`` (none by default)."""
        return {}

    def local_meta(self, shard: object) -> Sequence[int]:
        """This shard's ``meta_width`` values for the meta exchange."""
        return ()

    @abstractmethod
    def allocate(
        self, requests: np.ndarray, sizes: np.ndarray, round: int, meta: np.ndarray
    ) -> np.ndarray:
        """``int64 [learner, shard]`` counts of a round; rows sum to ``requests``.

        Args:
            requests: ``[world]`` batch size of each rank (0: not fetching).
            sizes: ``[world]`` items on each shard after this round's ingestion.
            round: the round number.
            meta: ``[world, meta_width]`` what every shard's ``local_meta`` gave.
        """

    @abstractmethod
    def expected(self, requests: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """``float [learner, shard]``: the mean of :meth:`allocate` over rounds."""

    def draw(self, count: int, size: int, round: int, stream: int = 0) -> torch.Tensor:
        """``count`` shard-local slots from ``[0, size)`` (default: uniform, with replacement).

        The stream is keyed by ``(seed, round, rank)`` (``stream=1``: a second stream of the
        round, ``(seed, round, OWN_KEY + rank)``, for draws made after the first's); the native
        draw (a splitmix64 stream) costs ~1 us where ``torch.randint`` with a reseeded generator
        cost ~9 us per round here.
        The returned tensor is valid until the next draw.
        """
        out = self.uniform(count, size, round, self.ctx.rank + stream * OWN_KEY)
        return out if self.shard is None else self.shard.live(out)

    def uniform(self, count: int, size: int, round: int, key: int) -> torch.Tensor:
        """``count`` int64 values uniform in ``[0, size)`` from the stream ``(seed, round, key)``
        (keys below ``world`` are the ranks' draw streams), in a reused buffer: valid until the
        next call."""
        if _native is None:
            gen = seeded(self._draw_gen, self.ctx.seed, round, key)
            return torch.randint(size, (count,), generator=gen, dtype=torch.int64)
        if self._slots.shape[0] < count:
            self._slots = torch.empty(max(count, 2 * self._slots.shape[0]), dtype=torch.int64)
        out = self._slots[:count]
        _native.uniform_slots(out.data_ptr(), count, size, self.ctx.seed, round, key)
        return out

    def feedback(self, round: int) -> None:  # noqa: B027 (default hook)
        """After delivery: nothing by default."""

    # ------------------------------------------------------------------ checkpoints

    def item_state(self, generations: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-item state a checkpoint keeps for the shard's live items ``generations`` (oldest
        first), e.g. priorities: none by default."""
        return {}

    def restore_begin(self, base: int) -> None:  # noqa: B027 (default hook)
        """A restore emptied the shard; its next item gets generation ``base``."""

    def restore_piece(  # noqa: B027 (default hook)
        self, generations: torch.Tensor, items: dict[str, torch.Tensor]
    ) -> None:
        """A restore appended one old shard's items (now ``generations``) with their
        :meth:`item_state`; pieces of different old shards are not linked."""

    def restore_state(
        self, states: list[dict[str, object]], exact: bool, rank: int, written: np.ndarray
    ) -> None:
        """Take the old shards' :meth:`state_dict` s after a restore.

        Args:
            states: every old rank's state.
            exact: same world size: this rank holds its own old items under their generations.
            rank: this rank.
            written: ``[world]`` the new shards' generation counters.
        """
        self.load_state_dict(states[rank] if exact else states[0])

    def state_dict(self) -> dict[str, object]:
        """Streams derive from ``(seed, round, rank)``: only the name is kept by default."""
        return {"name": self.name}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Check the checkpoint was taken with the same kind of sampler.

        Raises:
            ValueError: on another sampler's state.
        """
        if state.get("name") != self.name:
            raise ValueError(
                f"sampler: checkpoint has {state.get('name')!r}, plane has {self.name!r}"
            )
