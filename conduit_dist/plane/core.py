"""DataPlane: the public face over a plane's components (built by ``assembly.assemble``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from conduit_dist import state
from conduit_dist.assembly import assemble
from conduit_dist.collectives.model import BandwidthModel
from conduit_dist.errors import ConfigError, EmptyStoreError
from conduit_dist.placement import Placement
from conduit_dist.rounds import RoundStats
from conduit_dist.sampling import Sampler
from conduit_dist.sched import FetchTiming, Timeline, fetch_timing
from conduit_dist.sched.scheduler import now
from conduit_dist.spec import ExperienceSpec
from conduit_dist.tiers import Tiers


class DataPlane:
    """A sharded experience store whose ingestion and delivery are torch.distributed collectives.

    Every rank hosts one shard. ``put`` stages a batch; a *round* (one per ``fetch`` on learners,
    one per ``flush`` on actors, the same number on every rank) moves staged items to their
    shards in one fused ``all_to_all_single``, draws each learner's batch from the global store
    and delivers it in a second one. See docs/architecture.md for the components and a round.

    Args:
        spec: fields of one experience item.
        capacity_per_rank: items each rank's shard holds; the oldest are evicted first.
        seed: run seed; with the round number it fixes every sample drawn.
        sampler: a :class:`~conduit_dist.sampling.Sampler` or a name from
            ``registry.SAMPLERS`` (default ``uniform``: each batch i.i.d. over the global store).
        placement: a :class:`~conduit_dist.placement.Placement` or a name from
            ``registry.PLACEMENTS`` (default ``round_robin``).
        storage: a :class:`~conduit_dist.tiers.Tiers` (default: one memory tier on ``device``).
        learner_ranks: ranks that fetch; ``None``: every rank. Others are actors and ``flush``.
        device: where batches are delivered (``cpu`` or ``cuda``).
        schedule: ``overlap`` (the next round starts at the attached module's backward),
            ``sync`` (inside ``fetch``) or ``auto`` (each rank times ``auto_trial`` iterations of
            each, sync first, and keeps the faster). One CPU rank always runs rounds inline.
        max_lag: ``1``: a batch may miss this rank's puts made after its round was launched
            (one round of them at most); ``0``: never (overlap then only between
            ``fetch(..., more=True)`` minibatches).
        auto_trial: iterations timed per mode with ``schedule="auto"``.
        timeout_s: seconds any collective may take before it fails with ``RoundError``.
        strategy: ``auto`` (the bandwidth model picks) or a strategy name to force.
        bandwidth: ``declared`` (default numbers, no start-up cost), ``calibrate`` (probe the
            links, cached in ``bandwidth_cache``) or a ``BandwidthModel``; see :attr:`bandwidth`.
        bandwidth_cache: directory of calibration caches (``None``: no cache).
        trace: record a per-rank timeline for :meth:`export_trace`.

    Raises:
        ConfigError: on a bad argument, naming it (nothing is left behind: no group, no files).
    """

    def __init__(
        self,
        spec: ExperienceSpec,
        capacity_per_rank: int,
        seed: int = 0,
        *,
        sampler: str | Sampler = "uniform",
        placement: str | Placement = "round_robin",
        storage: Tiers | None = None,
        learner_ranks: Sequence[int] | None = None,
        device: str | torch.device = "cpu",
        schedule: str = "overlap",
        max_lag: int = 1,
        auto_trial: int = 50,
        timeout_s: float = 60.0,
        strategy: str = "auto",
        bandwidth: str | BandwidthModel = "declared",
        bandwidth_cache: str | None = "~/.cache/conduit_dist",
        trace: bool = False,
    ) -> None:
        self._closed = False
        p = assemble(
            spec, capacity_per_rank, seed, sampler=sampler, placement=placement, storage=storage,
            learner_ranks=learner_ranks, device=device, schedule=schedule, max_lag=max_lag,
            auto_trial=auto_trial, timeout_s=timeout_s, strategy=strategy, bandwidth=bandwidth,
            bandwidth_cache=bandwidth_cache, trace=trace, can_launch=self._can_launch,
        )  # fmt: skip
        self.spec, self.capacity_per_rank, self.device = (
            spec,
            capacity_per_rank,
            torch.device(device),
        )
        self.rank, self.world, self.learner_ranks = (
            p.exchange.rank,
            p.exchange.world,
            p.learner_ranks,
        )
        self.is_learner = self.rank in self.learner_ranks
        self.shard, self.sampler, self.placement = p.shard, p.sampler, p.placement
        self.topology, self.bandwidth, self.calibration_s = p.topology, p.bandwidth, p.calibration_s
        self.timeline, self._p = p.timeline, p
        self._subset_gen = torch.Generator().manual_seed(int(seed) + 7 * self.rank)
        self._last: tuple | None = None  # what last_fetch is computed from

    def __len__(self) -> int:
        """Items stored over all shards as of the latest completed round."""
        return int(self._p.runner.published.sum())

    @property
    def sizes(self):
        """``int64 [world]``: items on each shard as of the latest completed round."""
        return self._p.runner.published

    @property
    def round(self) -> int:
        """Rounds this rank has prepared (the next round's number)."""
        return self._p.clock.round

    @property
    def stats(self) -> RoundStats:
        """What the latest finished round did on this rank."""
        return self._p.clock.stats

    def put(self, batch: Mapping[str, torch.Tensor], *, donate: bool = False) -> None:
        """Validate a batch and stage it for the next round.

        Args:
            batch: ``name -> tensor [B, *shape]`` matching the spec (any device).
            donate: hand the tensors over instead of copying them now (packed by the round,
                during backward when overlapping); do not modify them until it completed.

        Raises:
            SpecError: on a missing or extra field, wrong dtype or shape, disagreeing batch
                sizes, an empty batch or non-finite floats; nothing is staged or stored then.
            ConfigError: over the staging limit (the global capacity), or with ``max_lag=0``
                when the round for the next fetch is already in flight.
        """
        self._check_open()
        self._p.stager.put(batch, donate)

    def staged(self, n: int):
        """``with plane.staged(n) as rows:`` writable views (``name -> [n, *shape]``) into the
        next round's staging rows; uninitialised like ``torch.empty``. Leaving the block checks
        floats for NaN/inf in place and stages the items; an exception or a failed check stages
        nothing. No other plane call may run inside the block.

        Raises:
            ConfigError: for ``n < 1``, a nested block, the staging limit or ``max_lag=0``.
            SpecError: on leaving the block, naming a floating field that holds NaN/inf.
        """
        self._check_open()
        return self._p.stager.staged(n)

    def fetch(self, batch_size: int, *, more: bool = False) -> dict[str, torch.Tensor]:
        """This learner's batch, drawn by the sampler from the global store.

        Args:
            batch_size: items to return.
            more: another fetch follows before the next ``put`` (minibatches of one rollout).

        Returns:
            ``name -> tensor [batch_size, *shape]``: views into one packed buffer that is
            reused only once nothing references it; rows keep the record stride and are grouped
            by the shard they came from.

        Raises:
            ConfigError: on an actor, a bad ``batch_size``, or one larger than the round
                launched for it at backward.
            RoundError: if the round failed or timed out on some rank (names the rank).
            EmptyStoreError: if nothing is stored yet (the round itself completed).
        """
        if not self.is_learner:
            raise ConfigError(
                f"fetch: rank {self.rank} is an actor (learner_ranks={list(self.learner_ranks)}); "
                "actors call flush() once per iteration instead"
            )
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size: expected an int >= 1, got {batch_size!r}")
        self._check_open()
        t_wait = now()
        records, stats, prefetched, lag = self._p.control.fetch_round(batch_size, more)
        rows = records.shape[0]
        if rows == 0:
            raise EmptyStoreError(
                f"fetch({batch_size}) on rank {self.rank} in round {stats.round}: the store is "
                f"empty (0 items over {self.world} shards); put experience before fetching"
            )
        if rows < batch_size:
            raise ConfigError(
                f"fetch: batch_size {batch_size} is larger than the {rows} items of the round "
                "launched for it at backward; keep the batch size fixed, or use schedule='sync'"
            )
        if rows > batch_size:  # a uniform random subset of i.i.d. draws is i.i.d. too
            keep = torch.randperm(rows, generator=self._subset_gen)[:batch_size]
            records = records.index_select(0, keep.to(records.device))
        batch = self.spec.unpack(records)
        self._last = (stats, prefetched, lag, t_wait, now())
        self.timeline.add("fetch (waiting)", Timeline.LEARNER, t_wait, self._last[4])
        return batch

    def flush(self) -> None:
        """Take part in a round without fetching (actors, once per iteration after ``put``);
        in ``overlap`` mode it runs in the background and this returns at once.

        Raises:
            RoundError: if a round failed or timed out on some rank.
        """
        self._check_open()
        self._p.control.flush()

    def wait(self) -> None:
        """Block until no round is running (e.g. before ``len(plane)`` after an overlapped
        ``flush``); a round launched at backward stays attributed to the next fetch.

        Raises:
            RoundError: if the finished round failed (also one launched at backward).
        """
        self._check_open()
        self._p.control.wait()

    def attach(self, module: nn.Module) -> None:
        """Launch the next fetch's round when ``module``'s backward starts (``overlap``/``auto``).

        Raises:
            ConfigError: if a module is attached already.
        """
        self._p.control.attach(module)

    def detach(self) -> None:
        """Remove the backward hooks (a launched round still completes at the next call)."""
        self._p.control.detach()

    @property
    def chosen_schedule(self) -> str:
        """The schedule in force on this rank (``auto (trial)`` while ``auto`` is timing)."""
        return self._p.control.chosen_schedule

    def publish_weights(self, module: nn.Module) -> int:
        """Stage ``module``'s state for broadcast in the next round (first learner only; a no-op
        elsewhere). Returns the version the weights will carry."""
        self._check_open()
        if self.rank == self.learner_ranks[0]:
            self._p.weights.publish(_unwrap(module))
        return self._p.weights.version

    def pull_weights(self, module: nn.Module) -> int:
        """Load the latest weights received into ``module``; returns their version (0: none yet,
        ``module`` untouched). An overlapped actor gets the previous round's weights.

        Raises:
            SpecError: if the module's names, shapes or dtypes differ from the published ones.
        """
        self._check_open()
        return self._p.weights.pull(_unwrap(module))

    def store_stats(self) -> dict[str, object]:
        """This rank's shard: items and bytes per tier, demotions and evictions so far (counting
        items dropped at staging, also shown alone); waits for a running round first (one launched at backward stays for
        its fetch)."""
        self._p.sched.settle()
        stats, dropped = self.shard.stats(), self._p.stager.dropped
        return {**stats, "evictions": stats["evictions"] + dropped, "dropped_at_staging": dropped}

    def export_trace(self, path: str) -> str:
        """Write this rank's timeline as Chrome trace JSON (open in Perfetto); returns the path.

        Raises:
            ConfigError: if the plane was built without ``trace=True``.
        """
        if not self.timeline.enabled:
            raise ConfigError("export_trace: tracing is off; build the plane with trace=True")
        return self.timeline.export(path)

    @property
    def last_fetch(self) -> FetchTiming | None:
        """Exposed/hidden accounting of the latest fetch (``None`` before the first)."""
        return None if self._last is None else fetch_timing(*self._last)

    def close(self) -> None:
        """Run the closing round, remove hooks, release the group. Safe to call twice.

        Collective: every rank calls it (a round launched at backward serves as that rank's
        closing round; others run one, which also ingests anything still staged).

        Raises:
            RoundError: if the closing round fails (the group is released all the same).
            ConfigError: inside a ``staged()`` block.
        """
        if self._closed:
            return
        if self._p.stager.in_block:
            raise ConfigError("close: cannot run inside a staged() block: leave the block first")
        self.detach()
        p = self._p
        try:
            if p.clock.failed is None:
                p.control.closing_round()
        finally:
            self._closed = True
            if p.sched.close(abandon=p.clock.failed is not None):
                p.exchange.close()
                p.shard.close()

    def state_dict(self) -> dict[str, object]:
        """This rank's shard, the global sizes, the round counter (tensors and ints only).

        Not collective: it waits for this rank's running round, whose batch stays for the next
        fetch. Call it at the same point of the loop on every rank, between rounds.

        Raises:
            RuntimeError: if items were put since the last round (run a round first).
            RoundError: if the running round failed.
        """
        self._check_open()
        self._p.control.wait()
        return state.save(self._p, self.spec)

    def load_state_dict(self, saved: dict[str, object]) -> None:
        """Restore a state saved by :meth:`state_dict` (same world size, spec and storage).

        Collective: every rank calls it; a round launched before it is dropped, and the ranks
        check they all restored the same round.

        Raises:
            ConfigError: on another world size, spec or storage, or ranks at different rounds.
        """
        self._check_open()
        state.load(self._p, self.spec, saved)

    def _can_launch(self) -> bool:
        return not self._closed and self._p.clock.failed is None and not self._p.stager.in_block

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the DataPlane is closed")
        if self._p.stager.in_block:
            raise ConfigError("this call cannot run inside a staged() block: leave the block first")
        self._p.clock.check()


def _unwrap(module: nn.Module) -> nn.Module:
    return module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module
