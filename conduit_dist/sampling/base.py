"""The sampler protocol: a narrow core every sampler implements, and small capability
protocols the round engine checks by type.

Core (:class:`Sampler`), called on every rank:

- ``bind(ctx)`` and ``attach(storage, spec)`` once, when the plane is built;
- ``allocate(requests, sizes, round, meta)`` each round, after ingestion: the ``[learner,
  shard]`` counts. Every rank calls it with the same inputs and gets the same counts, with no
  extra round trip (a sampler seeds its streams from ``(seed, round)``);
- ``draw(count, round, stream)`` on each shard: the *generations* of its share (the storage
  gathers them, wherever they are stored);
- ``expected(requests, sizes)``: the mean allocation (placement prices plans with it);
- ``state_dict`` / ``load_state_dict``.

Capabilities (a sampler subclasses the ones it has; legal combinations follow from the types):

- :class:`Speculative`: draws are i.i.d. whatever the allocation, so a shard may send a learner
  candidates before the allocation is known (one-exchange rounds);
- :class:`ReportsMeta`: adds values of its shard to the round's meta (e.g. priority masses),
  computed after the round's items are in;
- :class:`WritesRows`: composes the delivered rows itself (trailers, windows) and reads them back
  at the learner;
- :class:`RoutesFeedback`: learners queue updates (priorities) that rounds carry to the owners;
- :class:`Takes`: all or nothing per learner, and delivered items leave the store (queues);
- :class:`TracksInflow`: sees every shard's inflow each round (epochs over generations);
- :class:`Streams`: items form streams whose consecutive items must share a shard (windows);
- :class:`KeepsItemState`: per-item state a checkpoint saves and a restore rebuilds.

Streams derive from ``(seed, round, rank)``, so the built-in samplers carry no random state
between rounds. Samplers see the storage only through the :class:`~conduit_dist.tiers.base.Storage`
protocol (size, generations, ``gather``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from conduit_dist.errors import ConfigError
from conduit_dist.records.buffers import Prefixes
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
        device_rows: the plane's rows live where its storage is, on the GPU (or a CPU plane
            rehearses that path): a sampler composes rows there from host metadata
            (``sampling/device_rows.py``) and never reads the rows themselves on the host.
    """

    seed: int
    rank: int
    world: int
    links: np.ndarray
    device_rows: bool = False


class Sampler(ABC):
    """Decides what each learner gets (the core protocol; see the module docstring).

    Attributes:
        name: the sampler's name (``registry.SAMPLERS``; checked when a checkpoint is loaded).
        ctx: the plane's context, set by :meth:`bind`.
        storage: this rank's shard (a ``Storage``), set by :meth:`attach`.
    """

    name: str = "abstract"

    def __init__(self) -> None:
        self.ctx: SamplerContext | None = None
        self.storage = None
        self._values = Prefixes(torch.int64, torch.device("cpu"))  # reused by the native draw

    def bind(self, ctx: SamplerContext) -> None:
        """Attach to a plane (called once, when the plane is built)."""
        self.ctx = ctx

    def attach(self, storage, spec) -> None:
        """Called once the plane's shard is built, with the stored records' spec."""
        self.storage = storage

    @abstractmethod
    def allocate(
        self, requests: np.ndarray, sizes: np.ndarray, round: int, meta: np.ndarray
    ) -> np.ndarray:
        """``int64 [learner, shard]`` counts of a round; each row sums to the learner's request,
        or to 0 (it gets nothing this round).

        Args:
            requests: ``[world]`` batch size of each rank (0: not fetching).
            sizes: ``[world]`` items on each shard after this round's ingestion.
            round: the round number.
            meta: ``[world, meta_width]`` what every shard's ``local_meta`` gave
                (:class:`ReportsMeta`; ``[world, 0]`` otherwise).
        """

    @abstractmethod
    def expected(self, requests: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """``float [learner, shard]``: the mean of :meth:`allocate` over rounds."""

    def draw(self, count: int, round: int, stream: int = 0) -> torch.Tensor:
        """``count`` generations of this shard's live items (default: uniform, with
        replacement), valid until the next draw.

        The stream is keyed by ``(seed, round, rank)`` (``stream=1``: a second stream of the
        round, ``(seed, round, OWN_KEY + rank)``, for draws made after the first's).
        """
        st = self.storage
        key = self.ctx.rank + stream * OWN_KEY
        return self.uniform(count, st.size, round, key, offset=st.written - st.size)

    def uniform(self, count: int, size: int, round: int, key: int, offset: int = 0) -> torch.Tensor:
        """``count`` int64 values uniform in ``offset + [0, size)`` from the stream ``(seed,
        round, key)``, in a reused buffer (valid until the next call). The native stream
        (splitmix64) costs ~1 us where ``torch.randint`` with a reseeded generator cost ~9 us
        a round here; without the extension, ``torch.randint`` with the same keys."""
        if _native is None:
            gen = seeded(torch.Generator(), self.ctx.seed, round, key)
            return torch.randint(size, (count,), generator=gen, dtype=torch.int64) + offset
        out = self._values.first(count)
        _native.uniform_slots(out.data_ptr(), count, size, self.ctx.seed, round, key, offset)
        return out

    def empty_reason(self, batch_size: int, stored: int) -> str:
        """Why a learner got nothing while ``stored`` items are in the store."""
        return (
            f"nothing can be drawn yet ({stored} items stored over all shards, none a start: a "
            "sampler's windows are not complete yet, or every priority is 0)"
        )

    def stats(self) -> dict[str, int]:
        """Counters for ``store_stats`` (none by default)."""
        return {}

    def restore_state(
        self, states: list[dict[str, object]], exact: bool, rank: int, written: np.ndarray
    ) -> None:
        """Take the old shards' :meth:`state_dict` s after a checkpoint restore.

        Args:
            states: every old rank's state.
            exact: same world size: this rank holds its own old items under their generations.
            rank: this rank.
            written: ``[world]`` the new shards' generation counters.
        """
        self.load_state_dict(states[rank] if exact else states[0])

    def check_state(self, state: dict[str, object]) -> None:
        """Refuse, before anything is loaded, a state this sampler cannot take.

        Raises:
            ConfigError: on another sampler's state (by default: another name).
        """
        if state.get("name") != self.name:
            raise ConfigError(
                f"sampler: the state is a {state.get('name')!r} sampler's, the plane has "
                f"{self.name!r}"
            )

    def state_dict(self) -> dict[str, object]:
        """Streams derive from ``(seed, round, rank)``: only the name is kept by default."""
        return {"name": self.name}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Check the state was saved by the same kind of sampler.

        Raises:
            ValueError: on another sampler's state.
        """
        if state.get("name") != self.name:
            raise ValueError(
                f"sampler: checkpoint has {state.get('name')!r}, plane has {self.name!r}"
            )


# ---------------------------------------------------------------------- capabilities


class Speculative(ABC):  # noqa: B024 (a capability: its methods have defaults)
    """A shard's draws for a learner do not depend on the allocation (i.i.d. draws, an
    allocation from requests, sizes and meta alone): a shard may send a learner candidates
    before the allocation is known, and a prefix of them is a valid share."""

    def shares(self, sizes: np.ndarray, meta: np.ndarray) -> np.ndarray:
        """``[world]`` each shard's probability of a draw in the round just allocated (sizes
        proportional by default; all 0 on an empty store): sizes the next round's candidates."""
        total = sum(sizes.tolist())  # a few values: Python beats numpy's call cost
        return sizes / total if total else np.zeros(sizes.shape[0])

    def drawable(self) -> bool:
        """Whether this shard can draw candidates now."""
        return True


class ReportsMeta(ABC):
    """Adds ``meta_width`` int64 values of its shard to every round's meta, computed after the
    round's items are in (rounds whose items arrive through a collective exchange them after
    ingestion)."""

    meta_width: int = 0

    @abstractmethod
    def local_meta(self) -> Sequence[int]:
        """This shard's ``meta_width`` values now."""


class WritesRows(ABC):
    """Composes delivered rows from its shard (trailers, windows) and reads them back at the
    learner."""

    @abstractmethod
    def layout(self, spec) -> tuple[object, int]:
        """``(stored spec, delivered row bytes)``."""

    @abstractmethod
    def write_rows(self, generations: torch.Tensor, out: torch.Tensor) -> None:
        """Write the delivered rows of draws ``generations`` into ``out``."""

    @abstractmethod
    def read_rows(self, rows: torch.Tensor, unpack) -> dict[str, torch.Tensor]:
        """A learner's delivered ``rows`` as fields and reserved entries (``unpack``: the plane's
        pooled field views of plain records)."""


class RoutesFeedback(ABC):
    """Learners queue updates for items of any shard (``DataPlane.update_priorities``); rounds
    carry them to the owners (one-exchange and header exchanges' update rows)."""

    @abstractmethod
    def queue_updates(self, index: torch.Tensor, value: torch.Tensor) -> None:
        """Check and queue updates (``ConfigError`` on bad values, nothing queued then)."""

    @abstractmethod
    def outgoing(self, budgets: dict[int, int]) -> dict[int, torch.Tensor]:
        """Queued updates to send, at most ``budgets[peer]`` pairs per peer."""

    @abstractmethod
    def incoming(self, rows: torch.Tensor) -> None:
        """Updates a peer sent this shard (``[k, 2]`` int64 views of the round's receive rows,
        valid only during the call: copy what is kept)."""


class Takes(ABC):
    """All or nothing per learner, and delivered items leave the store on every rank alike."""

    newest_first: bool = False  # taken items are the newest (a LIFO), else the oldest

    @abstractmethod
    def taken(self, counts: np.ndarray) -> np.ndarray | None:
        """``int64 [world]`` items each shard gives up after this round's delivery (``counts``:
        the round's allocation; the same on every rank); ``None``: none."""


class TracksInflow(ABC):
    """Sees every shard's inflow each round (replicated)."""

    @abstractmethod
    def ingested(self, inflow: np.ndarray) -> None:
        """``[world]`` items each shard took in this round."""


class ReadsColumns(ABC):
    """Reads a few bytes of every new record on the host (a window's ``done``, ``truncated``,
    ``stream`` and n-step ``reward``). On a device-rows plane the round hands it every block of
    records it ingests, as it lands in the shard (``sampling/device_rows.ColumnShadow``: host
    rows copied at once, device rows' columns copied to pinned memory without blocking), so the
    rows themselves never cross to the host."""

    @abstractmethod
    def ingested_rows(self, first: int, rows: torch.Tensor) -> None:
        """The records of generations ``first, first + 1, ...``, as this shard took them in
        (``uint8 [n, record_bytes]`` on any device; valid only during the call)."""


class Streams(ABC):
    """Items form streams (a producer's env, or the rank) whose consecutive items must share a
    shard: placements route each stream to one shard, and every shard learns which rank sent
    its new items."""

    @abstractmethod
    def stream_keys(self, records: torch.Tensor) -> torch.Tensor:
        """``int64 [n]`` the stream of each staged record (within the putting rank)."""

    @abstractmethod
    def arrived(self, sources: np.ndarray) -> None:
        """``[world]`` how many of this round's new items (in arrival order, by source rank)
        each rank sent this shard."""


class KeepsItemState(ABC):
    """Per-item state (priorities, stream links) a checkpoint saves and a restore rebuilds."""

    @abstractmethod
    def item_state(self, generations: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-item state of the live items ``generations`` (oldest first)."""

    @abstractmethod
    def restore_begin(self, base: int) -> None:
        """A restore emptied the shard; its next item gets generation ``base``."""

    @abstractmethod
    def restore_piece(self, generations: torch.Tensor, items: dict[str, torch.Tensor]) -> None:
        """A restore appended one old shard's items (now ``generations``) with their
        :meth:`item_state`; pieces of different old shards are not linked."""
