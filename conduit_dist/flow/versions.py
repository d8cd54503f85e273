"""Policy-version bounds: every item stores the version its producer acted with (``"_version"``,
see ``ExperienceSpec.with_version``); with ``max_policy_age=k`` no learner gets an item older
than the newest version its rank knows minus ``k`` (with actors and ``k >= 1``: the version it
knew a round earlier, which is what the actors know and their shards evict by, since a
published version reaches them in the next round; ``k = 0`` stays strict).

Two guards, neither silent:

- **At the shard**, at the start of every round, :class:`AgeBound` evicts the oldest items while
  their version is below the bound (the newest version this rank knew when the round was
  prepared, minus ``k``) and counts them; the count rides the round's meta values (or its
  header's size), so every rank's view of every shard's size stays exact. Staged items already
  below the bound are dropped before they are ingested. Shards are FIFO, so this removes every
  stale item when a shard's items arrive in version order (one producer per shard under
  ``local`` placement, or producers that pull the weights in step).
- **At the learner**, :func:`check_ages` looks at every delivered row: a stale one that the
  shard could not evict (it sat behind a newer item, or was put with an old ``version`` during
  the round) makes the fetch raise :class:`~conduit_dist.errors.StaleDataError`, naming the
  versions; the batch is never returned.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from conduit_dist.errors import ConfigError, StaleDataError
from conduit_dist.records.spec import VERSION, ExperienceSpec

log = logging.getLogger("conduit_dist")

_CHUNK = 64  # oldest items read per step of the eviction scan


def check_max_age(name: str, value: object) -> int | None:
    """``value`` as a bound (``None``: none).

    Raises:
        ConfigError: unless ``None`` or an int ``>= 0``.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name}: expected None or an int >= 0, got {value!r}")
    return value


class PolicyVersions:
    """The one owner of a rank's policy version numbers.

    ``tag`` is what this rank's puts carry unless told otherwise (what ``publish_weights`` or
    ``pull_weights`` last returned); ``publishes`` counts ``publish_weights`` calls; the weights
    (a :class:`~conduit_dist.flow.weights.WeightsState`) hold the newest version published or
    received. A round's ticket records :attr:`newest`, the reference of ``max_policy_age``.

    Args:
        weights: the plane's weights state.
        rank: this rank.
        learners: the learner ranks (each packs a version; those at the first learner's
            version share sending it to the other ranks).
    """

    def __init__(self, weights, rank: int = 0, learners: tuple[int, ...] = (0,)) -> None:
        self.weights, self.rank, self.learners = weights, rank, tuple(learners)
        self.tag = 0
        self.publishes = 0

    @property
    def newest(self) -> int:
        """The newest version this rank knows (published or received)."""
        return max(self.tag, self.weights.version)

    def publish(self, module: nn.Module) -> int:
        """Stage ``module``'s weights for the next round's broadcast (``publish_weights``).

        Every learner packs the whole version (a ``DataPlane``'s models are small; the pack is
        a snapshot); the next round splits the sending among the learners at the first
        learner's version (each sends its part, ``flow.weights.parts``, to every other rank), so
        no learner sends the whole model while learners publish in step, as under DDP. A
        learner behind the first (it skipped a publish) sends nothing and receives the version;
        one ahead of it neither sends nor receives it. A DDP wrapper is unwrapped.

        Returns:
            The version this rank's puts carry from now on.

        Raises:
            ConfigError: on an actor (actors pull).
            SpecError: if the module has no state or a tensor of an unsupported dtype.
        """
        if self.rank not in self.learners:
            raise ConfigError(
                f"publish_weights: rank {self.rank} is an actor; learners "
                f"{list(self.learners)} publish, actors pull_weights"
            )
        self.publishes += 1
        self.weights.publish(_unwrap(module))
        self.tag = self.weights.version
        return self.tag

    def pull(self, module: nn.Module) -> int:
        """Load the newest weights received into ``module`` (``pull_weights``; a DDP wrapper is
        unwrapped).

        Returns:
            Their version (0: none received yet), which this rank's puts carry from now on.

        Raises:
            SpecError: if their names, shapes or dtypes differ from the module's (nothing is
                copied then).
        """
        version = self.weights.pull(_unwrap(module))
        if version:
            self.tag = version
        return version

    def state_dict(self) -> dict[str, int]:
        """The put tag, the publications and the newest version received."""
        return {"put": self.tag, "published": self.publishes, "received": self.weights.version}

    def load_state_dict(self, state: dict[str, int], received: int | None = None) -> None:
        """Restore :meth:`state_dict` (``received``: the newest over every old rank, after a
        restore onto another world size)."""
        self.tag, self.publishes = int(state["put"]), int(state["published"])
        newest = int(state["received"]) if received is None else int(received)
        self.weights.version = max(self.weights.version, newest)


def _unwrap(module: nn.Module) -> nn.Module:
    return module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module


class AgeBound:
    """Evicts a shard's stale oldest items at round start.

    Args:
        spec: the stored records' spec (with ``"_version"``).
        max_age: the bound (``None``: nothing is evicted).
        device: where the shard gathers to (the plane's device).
    """

    def __init__(
        self, spec: ExperienceSpec, max_age: int | None, device: torch.device | str = "cpu"
    ) -> None:
        self.max_age = max_age
        self.evicted = 0  # items this shard evicted as stale
        self._col = spec.offsets[VERSION] // 8  # int64 column of the version in a record
        self._rows = torch.empty(_CHUNK, spec.record_bytes, dtype=torch.uint8, device=device)

    def state_dict(self) -> dict[str, int]:
        """Items this shard evicted as stale."""
        return {"evicted": self.evicted}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore :meth:`state_dict`."""
        self.evicted = int(state["evicted"])

    def evict(self, shard, newest: int) -> int:
        """Take the oldest items whose version is below ``newest - max_age`` out of ``shard``;
        returns how many (call after the shard settled: no background demotion running)."""
        if self.max_age is None or newest - self.max_age <= 0 or not shard.size:
            return 0
        bound, gone = newest - self.max_age, 0
        while gone < shard.size:
            k = min(_CHUNK, shard.size - gone)
            gens = torch.arange(shard.oldest + gone, shard.oldest + gone + k, dtype=torch.int64)
            rows = self._rows[:k]
            shard.gather(gens, rows)
            fresh = (rows.view(torch.int64)[:, self._col] >= bound).nonzero().cpu()
            if fresh.numel():
                gone += int(fresh[0, 0])
                break
            gone += k
        if gone:
            shard.take_oldest(gone)
            self.evicted += gone
        return gone

    def drop_direct(self, shard, n: int, newest: int) -> int:
        """Of ``n`` items ``put`` wrote straight into the rows the storage reserved, keep those
        at or above the bound, moved to the front in order; returns how many remain. Reads only
        the version column unless one is stale. Rows that overwrote live items are kept as they
        are (compacting them would leave live items' slots holding dropped rows): those stale
        items sit at the newest end, where the learner's check refuses them."""
        if self.max_age is None or not n or newest - self.max_age <= 0:
            return n
        if shard.overwrites_live(0, n):
            return n
        bound = newest - self.max_age
        skip, views = shard.reserve(0, n)  # the rows put wrote (the same until the commit)
        cols = [v.view(torch.int64)[:, self._col] for v in views]
        if skip or all(bool((c >= bound).all()) for c in cols):
            return n  # (more than the ring holds: the newest are kept as they are)
        fresh = torch.cat([v[c >= bound] for v, c in zip(views, cols, strict=True)])
        k = fresh.shape[0]
        at = 0
        for v in shard.reserve(0, k)[1]:
            v.copy_(fresh[at : at + v.shape[0]])
            at += v.shape[0]
        self.evicted += n - k
        return k

    def drop_staged(self, buf, newest: int) -> int:
        """Drop staged rows (a ``RecordBuffer``, packed) whose version is below the bound, in
        place, keeping the others in order; returns how many (rounds that ingest after their
        meta exchange: what they ingest must be fresh already)."""
        if self.max_age is None or buf is None or not buf.count or newest - self.max_age <= 0:
            return 0
        rows = buf.view()
        keep = rows.view(torch.int64)[:, self._col] >= newest - self.max_age
        k = int(keep.sum())
        gone = buf.count - k
        if gone:
            rows[:k] = rows[keep]
            buf.count = k
            self.evicted += gone
        return gone


def check_ages(version: torch.Tensor, newest: int, max_age: int, rank: int, round: int) -> None:
    """Raise unless every delivered row's version is within ``max_age`` of ``newest``.

    ``newest`` is the reference of the round that delivered the rows (what its rank knew when
    it was prepared), so a version published while the round ran does not age its batch.

    One host read per fetch (the oldest version, one reduction on the rows' device): the
    versions are a column of the delivered rows, which the host does not hold on a CUDA plane
    (the round's meta carries how many items each shard evicted, not the versions it delivered),
    and a stale batch must never be returned, so the verdict has to be on the host before
    ``fetch`` returns. No read at all while the bound is vacuous (``newest - max_age <= 0``).

    Args:
        version: the delivered rows' ``"_version"`` column (any device).
        newest: the reference version.
        max_age: the bound.
        rank: this rank (named in the error).
        round: the round that delivered the rows (named in the error).

    Raises:
        StaleDataError: naming how many rows are stale, their versions and the bound.
    """
    bound = newest - max_age
    if bound <= 0 or not version.numel():
        return
    if int(version.min()) >= bound:  # the one host read
        return
    stale = version < bound
    bad = version[stale]
    raise StaleDataError(
        f"fetch on rank {rank} in round {round}: {int(stale.sum())} of {version.numel()} "
        f"items carry policy versions {int(bad.min())}..{int(bad.max())}, older than the "
        f"newest version {newest} minus max_policy_age={max_age}; the batch was not "
        "returned (a shard evicts only its oldest stale items: keep each shard's items in "
        "version order, e.g. local placement, or pull weights in step)"
    )
