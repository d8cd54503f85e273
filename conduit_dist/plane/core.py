"""DataPlane: the public API over a sharded experience store (put/staged and attach: mixins)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from conduit_dist.collectives.exchange import Exchange
from conduit_dist.collectives.model import BandwidthModel, build
from conduit_dist.collectives.topology import discover
from conduit_dist.collectives.transport import Transport
from conduit_dist.errors import ConfigError, EmptyStoreError, RoundError
from conduit_dist.plane.overlap import Overlap
from conduit_dist.plane.producer import Producer
from conduit_dist.rounds import RoundRunner, RoundStats, RoundTicket
from conduit_dist.sched import BackwardTrigger, FetchTiming, Timeline, fetch_timing
from conduit_dist.sched.auto import AutoTrial
from conduit_dist.sched.scheduler import MODES, Scheduler, now
from conduit_dist.spec import ExperienceSpec
from conduit_dist.staging import DoubleBuffer
from conduit_dist.tiers import POLICIES, make_shard
from conduit_dist.weights import WeightsState

_plane_ids = itertools.count()
# declared link numbers (measured on 2 loopback gloo ranks, 2-core machine): used when not probing
DECLARED = (1.5e-4, {"self": 8.0, "host": 1.5, "net": 0.1})

__all__ = ["DataPlane", "RoundStats"]


class DataPlane(Producer, Overlap):
    """A sharded experience store whose ingestion and delivery are torch.distributed collectives.

    Every rank hosts one shard of ``capacity_per_rank`` items. ``put`` validates a batch and stages
    it locally; a *round* (one per ``fetch`` on learners, one per ``flush`` on actors; every rank
    runs the same number) moves staged items to their owner shards in one fused
    ``all_to_all_single``, draws each learner's batch uniformly from the global store, and delivers
    it in a second one.

    With ``schedule="overlap"`` and a module attached (:meth:`attach`), the round for the next
    ``fetch`` is launched when the module's backward pass starts and runs on a worker thread, so
    ``fetch`` only waits for what has not finished. Such a batch may miss this rank's puts made
    after the launch (at most one round of them, and only if ``max_lag >= 1``); every fetch reports
    its lag and its exposed/hidden time in :attr:`last_fetch`.

    Args:
        spec: fields of one experience item.
        capacity_per_rank: items each rank's shard holds; the oldest are overwritten first.
        seed: run seed; with the round number it fixes every sample drawn.
        device: where the shard lives and batches are delivered (``cpu`` or ``cuda``).
        placement: ``round_robin`` (shards fill evenly), ``local`` (items stay where put) or
            ``bandwidth_aware`` (the plan the bandwidth model prices cheapest to ingest and
            then deliver from; see ``tiers/placement.py``).
        learner_ranks: ranks that fetch; ``None`` means every rank (colocated). The other ranks
            are actors: they ``put`` and call :meth:`flush` once per iteration.
        timeout_s: seconds any collective of a round may take before it fails with
            :class:`RoundError`.
        schedule: ``overlap`` (default), ``sync`` (request-driven: the round runs inside
            ``fetch``) or ``auto`` (each learner times ``auto_trial`` iterations in each mode,
            sync first, and keeps the faster; see :attr:`chosen_schedule`). A single CPU rank has
            nothing to overlap and always runs rounds inline.
        auto_trial: iterations timed per mode with ``schedule="auto"``.
        max_lag: rounds of this rank's own puts a fetched batch may miss (``0``: none; overlap
            then only happens between fetches announced with ``fetch(..., more=True)``).
        strategy: ``auto`` (the bandwidth model picks per exchange) or a strategy name to force:
            ``all_to_all``, ``p2p``, ``chunked4``, ``gather``.
        bandwidth: ``declared`` (the model from ``declared_bandwidth``; no start-up cost),
            ``calibrate`` (probe the links at start-up, cached in ``bandwidth_cache``), or a
            :class:`~conduit_dist.collectives.model.BandwidthModel`.
        declared_bandwidth: ``(latency_s, {"self": GB/s, "host": GB/s, "net": GB/s})``.
        bandwidth_cache: directory of calibration caches (``None``: no cache).
        trace: record a per-rank timeline for :meth:`export_trace` (a few microseconds per call).
        tiers: the shard's tiers, fastest first, as ``(kind, items)`` with kinds ``device``,
            ``pinned``, ``host``, ``disk``; the items must add up to ``capacity_per_rank``.
            Default: one memory tier on ``device``. Newest items live in the first tier; older
            ones are demoted down the list, and the last tier evicts its oldest.
        disk_dir: directory for ``disk`` tiers (files removed on close).
        tier_gbps: declared ``kind -> (read, write)`` GB/s per tier kind; configured ``tiers``
            of kinds not listed measure theirs at start-up (a write and a random-row gather of up
            to 16 MiB), shown in :meth:`store_stats`.
        demote_in_background: with several tiers, demote between rounds on a worker thread
            (evicting up to one round's inflow early once full; see ``tiers/tiered.py``) instead
            of inside the round that needs the room.
        sampling: ``exact`` (each learner's batch uniform over the global store) or
            ``stratified`` (shards contribute in proportion to their sizes over all learners,
            read local-first: colocated learners read mostly their own shard; one learner's batch
            is then not uniform on its own, see ``sampling/stratified.py``).

    Raises:
        ConfigError: on a bad capacity, placement, schedule, lag, device or learner rank.

    Example:
        >>> cd.init_distributed()
        >>> plane = cd.DataPlane(spec, capacity_per_rank=100_000, seed=0)
        >>> plane.attach(model)           # optional: overlap rounds with backward
        >>> plane.put(transitions)        # every iteration, on every rank
        >>> batch = plane.fetch(256)      # learners; actors call plane.flush() instead
    """

    def __init__(
        self,
        spec: ExperienceSpec,
        capacity_per_rank: int,
        seed: int = 0,
        *,
        device: str | torch.device = "cpu",
        placement: str = "round_robin",
        learner_ranks: Sequence[int] | None = None,
        timeout_s: float = 60.0,
        schedule: str = "overlap",
        max_lag: int = 1,
        strategy: str = "auto",
        bandwidth: str | BandwidthModel = "declared",
        declared_bandwidth: tuple[float, dict[str, float]] = DECLARED,
        bandwidth_cache: str | None = "~/.cache/conduit_dist",
        trace: bool = False,
        tiers: Sequence[tuple[str, int]] | None = None,
        disk_dir: str | None = None,
        tier_gbps: Mapping[str, Sequence[float]] | None = None,
        demote_in_background: bool = True,
        sampling: str = "exact",
        auto_trial: int = 50,
    ) -> None:
        if not isinstance(spec, ExperienceSpec):
            raise ConfigError(f"spec: expected an ExperienceSpec, got {type(spec).__name__}")
        if not isinstance(capacity_per_rank, int) or capacity_per_rank < 1:
            raise ConfigError(f"capacity_per_rank: expected an int >= 1, got {capacity_per_rank!r}")
        if placement not in POLICIES:
            raise ConfigError(f"placement: expected one of {POLICIES}, got {placement!r}")
        if sampling not in ("exact", "stratified"):
            raise ConfigError(f"sampling: expected 'exact' or 'stratified', got {sampling!r}")
        if schedule not in (*MODES, "auto"):
            raise ConfigError(f"schedule: expected one of {(*MODES, 'auto')}, got {schedule!r}")
        if not isinstance(max_lag, int) or max_lag < 0:
            raise ConfigError(f"max_lag: expected an int >= 0, got {max_lag!r}")
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s: expected > 0 seconds, got {timeout_s}")
        self.spec = spec
        self.device = torch.device(device)
        self.seed, self.placement, self.schedule, self.max_lag = (
            int(seed),
            placement,
            schedule,
            max_lag,
        )
        self.capacity_per_rank = capacity_per_rank
        self.exchange = Exchange(timeout_s, name=str(next(_plane_ids)))
        self.rank, self.world = self.exchange.rank, self.exchange.world
        self.learner_ranks = self._check_learners(learner_ranks)
        self.is_learner = self.rank in self.learner_ranks
        self.shard = make_shard(
            tiers,
            capacity_per_rank,
            spec.record_bytes,
            self.device,
            disk_dir,
            background=demote_in_background,
            gbps=tier_gbps,
        )
        self._weights = WeightsState()
        self.topology = discover(self.exchange.group)
        self.bandwidth, self.calibration_s = self._bandwidth(
            bandwidth, declared_bandwidth, bandwidth_cache
        )
        transport = Transport(self.exchange, self.topology, self.bandwidth, strategy)
        self._runner = RoundRunner(
            spec,
            self.shard,
            self.exchange,
            self.seed,
            placement,
            self.learner_ranks[0],
            self.device,
            transport,
            sampling,
            self.learner_ranks,
        )
        # one CPU rank has no collective to wait for: a background round would only add a thread
        # handoff, so rounds run inline there (the lag rules are those of sync: none)
        can_overlap = self.world > 1 or self.device.type == "cuda"
        self._overlap = schedule == "overlap" and can_overlap
        # schedule="auto": a per-rank trial, sync then overlap, keeps the faster (see _auto_tick)
        self._trial = AutoTrial(auto_trial) if schedule == "auto" and can_overlap else None
        self._sched = Scheduler(
            "overlap" if (self._overlap or self._trial) else "sync",
            self._runner,
            self._weights,
            self.device,
            timeout_s,
        )
        cuda = self.device.type == "cuda"
        self._stage = DoubleBuffer(spec.record_bytes, torch.device("cpu"), pin_memory=cuda)
        self.timeline = Timeline(self.rank, enabled=trace)
        self.round = 0  # rounds prepared so far (the next round's number)
        self.stats = RoundStats()
        self._last: tuple | None = None  # what last_fetch is computed from
        self._direct = 0  # items put straight into storage slots, counted at the next round
        self._put_seq = 0
        self._last_batch = 0
        self._more = False
        self._fetched = False  # a fetch happened since the last prefetch launch
        self._trigger: BackwardTrigger | None = None
        self._subset_gen = torch.Generator().manual_seed(self.seed + 7 * self.rank)
        self._failed: RoundError | None = None
        self._closed = False
        self._in_staged = False  # inside a staged() block

    def _bandwidth(self, bandwidth, declared, cache) -> tuple[BandwidthModel, float]:
        if isinstance(bandwidth, BandwidthModel):
            return bandwidth, 0.0
        if bandwidth not in ("declared", "calibrate"):
            raise ConfigError(
                f"bandwidth: expected 'declared', 'calibrate' or a model, got {bandwidth!r}"
            )
        latency_s, gbps = declared
        fallback = BandwidthModel.declared(latency_s, gbps)
        return build(self.exchange, self.topology, bandwidth == "calibrate", cache, fallback)

    def _check_learners(self, learner_ranks: Sequence[int] | None) -> tuple[int, ...]:
        if learner_ranks is None:
            return tuple(range(self.world))
        ranks = tuple(sorted({int(r) for r in learner_ranks}))
        if not ranks or any(not 0 <= r < self.world for r in ranks):
            raise ConfigError(
                f"learner_ranks: expected a non-empty subset of 0..{self.world - 1}, "
                f"got {list(learner_ranks)}"
            )
        return ranks

    # ------------------------------------------------------------------ public API

    def __len__(self) -> int:
        """Items stored over all shards as of the latest completed round."""
        return int(self._runner.sizes.sum())

    @property
    def sizes(self):
        """``int64 [world]``: items on each shard as of the latest completed round."""
        return self._runner.sizes

    def fetch(self, batch_size: int, *, more: bool = False) -> dict[str, torch.Tensor]:
        """Return this learner's batch, sampled uniformly with replacement from the global store.

        Runs this call's round, or waits for the one launched at the last backward.

        Args:
            batch_size: items to return.
            more: another fetch follows before the next ``put`` (minibatches of one rollout); with
                ``max_lag=0`` only such fetches let the next round start during backward.

        Returns:
            ``name -> tensor [batch_size, *shape]`` on the plane's device. The tensors are views
            into one packed buffer the plane reuses only once nothing references it (rows keep
            the record stride; call ``.contiguous()`` where a kernel needs dense rows). Rows are
            grouped by the shard they came from (this rank's own shard last).

        Raises:
            ConfigError: on an actor rank, a non-positive ``batch_size``, or a batch size larger
                than the round launched for it at backward.
            RoundError: if the round failed or timed out on some rank.
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
        prefetched, lag = False, 0
        pending = self._sched.pending
        if pending is not None and pending.kind == "prefetch":
            p, records, stats = self._guard(self._sched.wait)
            prefetched, lag = True, int(self._put_seq > p.put_seq)
        else:
            if pending is not None:
                self._finish(*self._guard(self._sched.wait)[1:])
            records, stats = self._guard(lambda: self._sched.run(self._prepare(batch_size)))
        self._finish(records, stats)
        self._fetched, self._last_batch, self._more = True, batch_size, more
        if self._trial is not None:
            self._auto_tick(t_wait)
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
        self._account(stats, prefetched, lag, t_wait, now())
        return batch

    def flush(self) -> None:
        """Take part in a round without fetching: move staged items to their shards.

        Actors call this once per iteration (after their ``put``), where learners call
        :meth:`fetch`. In ``overlap`` mode the round runs in the background and this call returns
        at once (after the previous round finished).

        Raises:
            RoundError: if a round failed or timed out on some rank.
        """
        self._check_open()
        pending = self._sched.pending
        if pending is not None:
            _, records, stats = self._guard(self._sched.wait)
            self._finish(records, stats)
            if pending.kind == "prefetch":  # launched at backward: it is this call's round
                return
        ticket = self._prepare(0)
        if self._overlap:
            self._sched.launch(ticket, "flush", self._put_seq)
        else:
            self._finish(*self._guard(lambda: self._sched.run(ticket)))

    def wait(self) -> None:
        """Block until no round is running (e.g. before reading ``len(plane)`` after an
        overlapped ``flush``). A round launched at backward stays attributed to the next fetch.

        Raises:
            RoundError: if the finished round failed.
        """
        self._check_open()
        pending = self._sched.pending
        if pending is None:
            return
        if pending.kind == "flush":
            self._finish(*self._guard(self._sched.wait)[1:])
        else:
            self._sched.settle()

    def publish_weights(self, module: nn.Module) -> int:
        """Stage ``module``'s state for broadcast to every rank in the next round.

        Only the first learner rank publishes; on other ranks this is a no-op returning the
        latest version seen.

        Args:
            module: the learner's module (plain or DDP-wrapped).

        Returns:
            The version number the weights will carry.
        """
        self._check_open()
        if self.rank == self.learner_ranks[0]:
            self._weights.publish(_unwrap(module))
        return self._weights.version

    def pull_weights(self, module: nn.Module) -> int:
        """Load the latest weights received from the learners into ``module``.

        In ``overlap`` mode an actor's ``flush`` returns before its round ends, so this loads the
        weights of the previous round (one round older).

        Args:
            module: a module with the same parameters and buffers as the learner's.

        Returns:
            The version loaded (0 when nothing was published yet; ``module`` is left untouched).

        Raises:
            SpecError: if the module's state does not match the published layout.
        """
        self._check_open()
        return self._weights.pull(_unwrap(module))

    def store_stats(self) -> dict[str, object]:
        """This rank's shard: items and bytes per tier, demotions and evictions so far."""
        return self.shard.stats()

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
        if self._last is None:
            return None
        return fetch_timing(*self._last)

    def close(self) -> None:
        """Run the closing round, remove hooks, release the group. Safe to call twice.

        Collective: every rank calls it. A round launched at backward on a learner has no call to
        belong to any more, so it serves as that rank's closing round; ranks without one run a
        closing round (which also ingests anything still staged), so every rank runs the same
        number of rounds.

        Raises:
            RoundError: if the closing round fails (the group is released all the same).
            ConfigError: inside a ``staged()`` block.
        """
        if self._closed:
            return
        if self._in_staged:
            raise ConfigError("close: cannot run inside a staged() block: leave the block first")
        self.detach()
        try:
            if self._failed is None:
                pending = self._sched.pending
                if pending is not None:
                    self._finish(*self._guard(self._sched.wait)[1:])
                if pending is None or pending.kind != "prefetch":
                    self._finish(*self._guard(lambda: self._sched.run(self._prepare(0))))
        finally:
            self._closed = True
            self._sched.close(abandon=self._failed is not None)
            self.exchange.close()
            self.shard.close()

    def state_dict(self) -> dict[str, object]:
        """This rank's shard, the global sizes and the round counter (tensors and ints only).

        Raises:
            RuntimeError: if items were put since the last round (call ``flush()`` first).
        """
        self._guard(self._sched.drain)
        if self._direct or self._stage.current.count:
            raise RuntimeError(
                "state_dict: items were put since the last round; call flush() (or fetch) first"
            )
        return {
            "round": self.round,
            "runner": self._runner.state_dict(),
            "shard": self.shard.state_dict(),
            "spec": self.spec.state_dict(),
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore a state saved by :meth:`state_dict` on the same world size and spec.

        Raises:
            ConfigError: on a different world size or spec.
        """
        if state["spec"] != self.spec.state_dict():
            raise ConfigError(
                f"spec: checkpoint has {state['spec']}, plane has {self.spec.state_dict()}"
            )
        world = state["runner"]["sizes"].shape[0]
        if world != self.world:
            raise ConfigError(f"world size: checkpoint has {world}, plane has {self.world}")
        self.shard.load_state_dict(state["shard"])
        self._runner.load_state_dict(state["runner"])
        self.round = int(state["round"])

    # ------------------------------------------------------------------ rounds

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the DataPlane is closed")
        if self._in_staged:
            raise ConfigError("this call cannot run inside a staged() block: leave the block first")
        if self._failed is not None:
            raise RoundError(
                f"the DataPlane failed in round {self._failed.round} and cannot continue: "
                f"{self._failed}",
                self._failed.round,
                self._failed.ranks,
            )

    def _guard(self, fn):
        try:
            return fn()
        except RoundError as exc:
            self._failed = exc
            raise

    def _prepare(self, request: int) -> RoundTicket:
        """Snapshot what the next round moves (called on the thread that owns ``put``)."""
        ticket = RoundTicket(
            self.round, request, self._stage.take(), self._direct, self._weights.snapshot()
        )
        self._direct = 0
        self.round += 1
        return ticket

    def _finish(self, records: torch.Tensor, stats: RoundStats) -> None:
        self.stats = stats
        if not self.timeline.enabled:
            return
        for phase, (a, b) in stats.spans.items():
            self.timeline.add(phase, Timeline.PLANE, a, b, round=stats.round)

    def _account(
        self, stats: RoundStats, prefetched: bool, lag: int, t_wait: float, t_end: float
    ) -> None:
        self._last = (stats, prefetched, lag, t_wait, t_end)
        self.timeline.add("fetch (waiting)", Timeline.LEARNER, t_wait, t_end, round=stats.round)


def _unwrap(module: nn.Module) -> nn.Module:
    return module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module
