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

import torch

from conduit_dist.errors import ConfigError, StaleDataError
from conduit_dist.records.spec import VERSION, ExperienceSpec

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
            shard.gather(shard.index_of(gens), rows)
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
        """Of ``n`` items ``put`` wrote straight into the slots ahead of ``shard``'s write
        position, keep those at or above the bound, moved to the front in order; returns how
        many remain (a general round ingests only those). Reads only the version column unless
        one is stale."""
        if self.max_age is None or not n or newest - self.max_age <= 0:
            return n
        bound = newest - self.max_age
        skip, views = shard.direct_views(0, n)
        cols = [v.view(torch.int64)[:, self._col] for v in views]
        if skip or all(bool((c >= bound).all()) for c in cols):
            return n  # (more than the ring holds: the newest are kept as they are)
        fresh = torch.cat([v[c >= bound] for v, c in zip(views, cols, strict=True)])
        k = fresh.shape[0]
        at = 0
        for v in shard.direct_views(0, k)[1]:
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

    Raises:
        StaleDataError: naming how many rows are stale, their versions and the bound.

    ``newest`` is the reference of the round that delivered the rows (what its rank knew when
    it was prepared), so a version published while the round ran does not age its batch.
    """
    bound = newest - max_age
    if bound <= 0:
        return
    stale = version < bound
    if bool(stale.any()):
        bad = version[stale]
        raise StaleDataError(
            f"fetch on rank {rank} in round {round}: {int(stale.sum())} of {version.numel()} "
            f"items carry policy versions {int(bad.min())}..{int(bad.max())}, older than the "
            f"newest version {newest} minus max_policy_age={max_age}; the batch was not "
            "returned (a shard evicts only its oldest stale items: keep each shard's items in "
            "version order, e.g. local placement, or pull weights in step)"
        )
