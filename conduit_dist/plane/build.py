"""Building a plane's components: one function that checks the arguments, discovers the topology,
picks the bandwidth model, builds storage, sampler, placement, flow control, the round engine and
scheduling, and releases everything it created (process group, disk files, threads) if a step
fails."""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from conduit_dist import syncs
from conduit_dist.collectives.dist import chosen_cuda_backend, resolve_device
from conduit_dist.collectives.exchange import Exchange
from conduit_dist.collectives.model import BandwidthModel, build
from conduit_dist.collectives.topology import Topology, discover
from conduit_dist.collectives.transport import Transport, check_cuda_strategy
from conduit_dist.errors import ConfigError
from conduit_dist.flow.ratelimit import RateLimiter
from conduit_dist.flow.versions import AgeBound, PolicyVersions, check_max_age
from conduit_dist.flow.weights import WeightsState
from conduit_dist.placement import Placement, PlacementContext
from conduit_dist.plane.options import TransportConfig
from conduit_dist.plane.producer import Stager
from conduit_dist.records.spec import ExperienceSpec
from conduit_dist.registry import (
    MAX_LAGS,
    PLACEMENTS,
    SAMPLERS,
    SCHEDULES,
    check_choice,
    default_placement,
    resolve,
)
from conduit_dist.rounds.devices import plan_devices
from conduit_dist.rounds.engine import RoundEngine
from conduit_dist.sampling import (
    Sampler,
    SamplerContext,
    WritesRows,
)
from conduit_dist.sched import Timeline
from conduit_dist.sched.auto import AutoTrial
from conduit_dist.sched.clock import RoundClock
from conduit_dist.sched.overlap import OverlapController
from conduit_dist.sched.scheduler import Scheduler
from conduit_dist.syncs import SYNCS
from conduit_dist.tiers import Storage, Tiers

log = logging.getLogger("conduit_dist")
_plane_ids = itertools.count()
# declared link numbers (measured on 2 loopback gloo ranks, 2-core machine): used when not probing
DECLARED = (1.5e-4, {"self": 8.0, "host": 1.5, "net": 0.1})


@dataclass
class Parts:
    """A plane's components (see docs/architecture.md for how a round uses them)."""

    exchange: Exchange
    topology: Topology
    bandwidth: BandwidthModel
    calibration_s: float
    learner_ranks: tuple[int, ...]
    storage: Storage
    sampler: Sampler
    placement: Placement
    ages: AgeBound
    limiter: RateLimiter | None
    engine: RoundEngine
    sched: Scheduler
    weights: WeightsState
    versions: PolicyVersions
    timeline: Timeline
    stager: Stager
    clock: RoundClock
    control: OverlapController

    def store_stats(self, **extra: int) -> dict[str, object]:
        """The shard's stats now (a running round is not waited for: it may need peers that
        are busy elsewhere), evictions counting items dropped at staging, the sampler's and the
        flow control's counters, and ``extra`` ones."""
        stats, dropped = self.storage.stats(), self.stager.dropped
        out = {**stats, "evictions": stats["evictions"] + dropped, "dropped_at_staging": dropped}
        out.update(self.sampler.stats(), stale_evicted=self.ages.evicted, **extra)
        out["host_syncs"] = SYNCS.snapshot()  # the library's deliberate ones, by reason
        if self.limiter is not None:
            lim = self.limiter
            out.update(
                rate_inserted=lim.inserted, rate_sampled=lim.sampled,
                rate_blocked_sample_s=lim.blocked_s["sample"],
                rate_blocked_insert_s=lim.blocked_s["insert"],
            )  # fmt: skip
        return out


def release(parts: Parts) -> None:
    """Run the closing round (unless a round failed), remove hooks, release the group, the shard
    and the worker. After a failure the group and the shard are freed only once the worker has
    left its round.

    Raises:
        ConfigError: inside a ``staged()`` block (nothing is released then).
        RoundError: if the closing round fails (everything is released all the same).
    """
    if parts.stager.in_block:
        raise ConfigError("close: cannot run inside a staged() block: leave the block first")
    parts.control.detach()
    parts.clock.closed = True
    try:
        if parts.clock.failed is None:
            parts.control.closing_round()
    finally:
        if parts.sched.close(abandon=parts.clock.failed is not None):
            try:
                parts.exchange.close(drain=parts.clock.failed is None)
            finally:
                parts.storage.close()
        else:
            log.warning(
                "rank %d: the round worker is still inside a failed round; the plane's group "
                "and shard are left to the process exit",
                parts.exchange.rank,
            )


def check_args(spec, capacity: int, schedule: str, max_lag: int) -> None:
    """The plain-value arguments of a plane.

    Raises:
        ConfigError: naming the argument, the expected and the received value.
    """
    if not isinstance(spec, ExperienceSpec):
        hint = " (token sequences travel through cd.TokenPlane)" if hasattr(spec, "ragged") else ""
        raise ConfigError(f"spec: expected an ExperienceSpec, got {type(spec).__name__}{hint}")
    if not isinstance(capacity, int) or capacity < 1:
        raise ConfigError(f"capacity_per_rank: expected an int >= 1, got {capacity!r}")
    check_choice("schedule", schedule, SCHEDULES)
    check_choice("max_lag", max_lag, MAX_LAGS)


def rank_set(field: str, ranks: Sequence[int] | None, world: int) -> tuple[int, ...]:
    """``ranks`` sorted and checked (``None``: every rank).

    Raises:
        ConfigError: naming ``field`` when the set is empty or holds a rank outside the job.
    """
    if ranks is None:
        return tuple(range(world))
    out = tuple(sorted({int(r) for r in ranks}))
    if not out or any(not 0 <= r < world for r in out):
        raise ConfigError(
            f"{field}: expected a non-empty subset of 0..{world - 1}, got {list(ranks)}"
        )
    return out


def bandwidth_model(
    bandwidth, ex: Exchange, topo: Topology, cache, device: torch.device | None = None
) -> tuple[BandwidthModel, float]:
    """The plane's bandwidth model: the one given, the declared numbers, or calibrated (cached
    under ``cache``; ``device``: of rows on that device, probed there); returns it and the
    seconds calibration took. Collective."""
    if isinstance(bandwidth, BandwidthModel):
        return bandwidth, 0.0
    declared = BandwidthModel.declared(*DECLARED)
    return build(ex, topo, bandwidth == "calibrate", cache, declared, device)


def _unbound(obj, field: str):
    if getattr(obj, "ctx", None) is not None:
        raise ConfigError(
            f"{field}: this {type(obj).__name__} serves another plane; pass a new one"
        )
    return obj


def _check_reduce(numel: int, world: int, schedule: str) -> None:
    """``reduce_numel`` payloads ride a round's header exchange (host rows, see
    ``rounds.devices.rows_on_host``), in rounds that run inside ``fetch`` (at world size 1
    nothing is averaged).

    Raises:
        ConfigError: naming what is missing.
    """
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ConfigError(f"reduce_numel: expected an int >= 0, got {numel!r}")
    if not numel or world == 1:
        return
    if schedule != "sync":
        raise ConfigError(
            "reduce_numel: expected schedule='sync' (a round launched at backward would run "
            f"before the payload it averages exists), got {schedule!r}"
        )


def assemble(
    spec: ExperienceSpec,
    capacity: int,
    seed: int,
    *,
    sampler: str | Sampler,
    placement: str | Placement | None,
    storage: Tiers | None,
    learner_ranks: Sequence[int] | None,
    device: str | torch.device,
    schedule: str,
    max_lag: int,
    auto_trial: int,
    transport: TransportConfig,
    trace: bool,
    reduce_numel: int = 0,
    max_policy_age: int | None = None,
    rate_limiter: RateLimiter | None = None,
) -> Parts:
    """Build every component of a plane (arguments as :class:`~conduit_dist.plane.DataPlane`).

    Collective: every rank calls it at the same point (it creates the plane's process group and
    discovers hosts). If any step fails, what was built is released before the error propagates.

    Raises:
        ConfigError: on a bad argument (nothing is left behind).
    """
    check_args(spec, capacity, schedule, max_lag)
    max_policy_age = check_max_age("max_policy_age", max_policy_age)
    if rate_limiter is not None and not isinstance(rate_limiter, RateLimiter):
        raise ConfigError(
            f"rate_limiter: expected a conduit_dist.RateLimiter or None, got "
            f"{type(rate_limiter).__name__}"
        )
    if rate_limiter is not None and reduce_numel:
        raise ConfigError(
            "rate_limiter: not with reduce_numel > 0 (a held fetch's round would average the "
            "payload once more when it runs again)"
        )
    spec = spec.with_version()  # every item stores its producer's policy version
    sampler = _unbound(resolve("sampler", sampler, SAMPLERS, Sampler), "sampler")
    if placement is not None:
        placement = _unbound(resolve("placement", placement, PLACEMENTS, Placement), "placement")
    device = resolve_device(device)  # once: cuda:<index>, never a bare "cuda"
    if device.type == "cuda" and dist.is_initialized() and dist.get_world_size() > 1:
        check_cuda_strategy(transport.strategy, chosen_cuda_backend())  # before any collective
    if storage is not None and not isinstance(storage, Tiers):
        raise ConfigError(f"storage: expected a conduit_dist.Tiers, got {type(storage).__name__}")
    world = dist.get_world_size() if dist.is_initialized() else 1  # (torchrun without a
    # group: the Exchange below says to call init_distributed)
    learners = rank_set("learner_ranks", learner_ranks, world)
    if placement is None:
        placement = PLACEMENTS[default_placement(sampler, learners, world)]()
    _check_reduce(reduce_numel, world, schedule)
    # where tiers, rows and collectives go, decided before the group exists: a group through
    # which no CUDA tensor will pass is gloo alone, with no NCCL communicator
    plan = plan_devices(
        device=device, world=world, sampler=sampler, keeps_local=placement.keeps_local,
        first_tier=None if storage is None else storage.first_device(device),
        reduce_numel=reduce_numel,
        cuda_backend=chosen_cuda_backend() if device.type == "cuda" else "nccl",
    )  # fmt: skip
    syncs.allow(2 * transport.timeout_s)  # a stuck device makes host syncs fail, not hang
    with contextlib.ExitStack() as undo:
        ex = Exchange(
            transport.timeout_s,
            name=str(next(_plane_ids)),
            device=device if plan.cuda_group else "cpu",
            shared_memory=transport.shared_memory,
        )
        undo.callback(ex.close)
        # one CPU rank has no collective to wait for: a background round would only add a
        # thread handoff, so rounds run inline there (the lag rules are those of sync: none)
        can_overlap = ex.world > 1 or device.type == "cuda"
        if schedule != "sync" and not can_overlap:
            log.info(
                "schedule=%s: one CPU rank has nothing to overlap; rounds run inline", schedule
            )
        trial = AutoTrial(auto_trial) if schedule == "auto" and can_overlap else None
        overlap = schedule == "overlap" and can_overlap
        if trial is not None and plan.round_thread:
            # the trial lets each rank keep what it measured, but with NCCL rows every rank
            # must launch its rounds at the same point of its iteration (a round at backward
            # on one rank, at fetch on another, orders the plane's NCCL work and DDP's
            # differently): auto is overlap on every rank
            trial, overlap = None, True
            if ex.rank == 0:
                log.info("schedule=auto: overlap on every rank (%s)", plan.describe())
        mode = "overlap" if (overlap or trial) else "sync"
        # rows carry the sampler's trailer (e.g. a prioritized item's address and mass)
        stored, wire_bytes = (
            sampler.layout(spec) if isinstance(sampler, WritesRows) else (spec, spec.record_bytes)
        )
        # the default one tier goes where the rounds compose rows (plan_devices)
        where = plan.tier if storage is None else device
        shard = (storage or Tiers()).build(capacity, stored.record_bytes, where)
        undo.callback(shard.close)
        topo = discover(ex)
        model, calibration_s = bandwidth_model(
            transport.bandwidth, ex, topo, transport.bandwidth_cache
        )
        rows_model = None  # bulk rows on the GPU: NCCL calibrated on device tensors
        if plan.bulk in ("nccl", "gloo"):
            rows_model, more_s = bandwidth_model(
                transport.bandwidth, ex, topo, transport.bandwidth_cache, plan.rows
            )
            calibration_s += more_s
        links = topo.link_matrix()
        is_learner = np.zeros(ex.world, dtype=bool)
        is_learner[list(learners)] = True
        device_rows = plan.compose == "torch"
        sampler.bind(SamplerContext(int(seed), ex.rank, ex.world, links, device_rows))
        undo.callback(setattr, sampler, "ctx", None)  # reusable if the build fails
        sampler.attach(shard, stored)
        priced = rows_model or model  # placements price where the rows move
        placement.bind(
            PlacementContext(ex.world, links, is_learner, stored.record_bytes, priced, sampler)
        )
        undo.callback(setattr, placement, "ctx", None)
        moves = Transport(ex, topo, model, transport.strategy, rows_model)
        ages = AgeBound(stored, max_policy_age, shard.tiers[0].data.device)
        engine = RoundEngine(
            stored, shard, ex, sampler, placement, moves, (ages, rate_limiter), learners,
            plan, wire_bytes, reduce_numel,
        )  # fmt: skip
        weights = WeightsState(None, transport.weights_bucket_bytes)
        weights.transport = moves  # its topology and bandwidth model price a relay
        versions = PolicyVersions(weights, ex.rank, learners)
        sched = Scheduler(mode, engine, weights, device, transport.timeout_s, plan.round_thread)
        undo.callback(sched.close, True)
        timeline = Timeline(ex.rank, enabled=trace)
        # items that stay where they were put are written into the shard's slots by put
        direct = engine.schedule != "general"
        stager = Stager(
            stored, shard, ex.world, capacity * ex.world, sched, max_lag, timeline, device,
            versions, local=direct, reads=engine.ingest.reads,
        )  # fmt: skip
        clock = RoundClock(stager, weights, versions, sched, timeline, device)
        control = OverlapController(
            clock, sched, overlap, trial, max_lag, ex.rank, int(seed), ex.rank in learners
        )
        undo.pop_all()
    return Parts(
        ex, topo, model, calibration_s, learners, shard, sampler, placement, ages, rate_limiter,
        engine, sched, weights, versions, timeline, stager, clock, control,
    )  # fmt: skip
