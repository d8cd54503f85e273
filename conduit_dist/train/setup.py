"""What a ``TrainConfig`` asks of the data plane: learner ranks, placement, sampler, how
learners average gradients, and the plane itself (functions of the config and the world, the
same on every rank)."""

from __future__ import annotations

import torch

from conduit_dist.collectives.model import BandwidthModel
from conduit_dist.errors import ConfigError
from conduit_dist.plane import DataPlane
from conduit_dist.records.spec import ExperienceSpec
from conduit_dist.rl.buffers import SimpleBuffer
from conduit_dist.sampling import Prioritized, Sequence
from conduit_dist.tiers import Tiers
from conduit_dist.train.config import TrainConfig


def learner_ranks(cfg: TrainConfig, world: int) -> list[int]:
    """Every rank colocated; ``cfg.learner_ranks`` disaggregated.

    Raises:
        ConfigError: without an actor or a learner, or on ranks outside the world.
    """
    if cfg.mode == "colocated":
        return list(range(world))
    learners = sorted(set(cfg.learner_ranks))
    if world < 2 or not learners or len(learners) >= world:
        raise ConfigError(
            f"learner_ranks: disaggregated mode needs learners and at least one actor among "
            f"{world} ranks, got {list(cfg.learner_ranks)}"
        )
    if any(not 0 <= r < world for r in learners):
        raise ConfigError(f"learner_ranks: expected ranks in 0..{world - 1}, got {learners}")
    return learners


def placement(cfg: TrainConfig) -> str:
    """``auto``: ``local`` colocated or with prioritized replay or n-step windows; else
    ``round_robin`` disaggregated (``local`` would leave the learners' shards empty: the store
    would hold only the actors' capacity)."""
    if cfg.plane.placement != "auto":
        return cfg.plane.placement
    if cfg.mode == "colocated" or cfg.plane.sampler == "prioritized" or cfg.algo.n_step > 1:
        return "local"  # prioritized replay and n-step windows run on one-exchange rounds
    return "round_robin"


def sampler(cfg: TrainConfig):
    """``plane.sampler`` as a name, or a ``Prioritized`` built from ``plane.prioritized``
    (with ``algo.n_step > 1`` n-step windows over each env's stream; uniform sampling of them
    is ``Prioritized`` with ``alpha = 0``).

    Raises:
        ConfigError: on n-step windows with a sampler other than uniform or prioritized.
    """
    pc, algo = cfg.plane, cfg.algo
    seq = None
    if algo.n_step > 1:
        seq = Sequence(
            n_step=algo.n_step, gamma=algo.gamma, done="done", truncated="truncated",
            stream="env",
        )  # fmt: skip
        if pc.sampler == "uniform":
            return Prioritized(alpha=0.0, beta=0.0, eps=0.0, sequence=seq)
    if pc.sampler != "prioritized":
        if seq is not None:
            raise ConfigError(
                f"algo.n_step: n-step windows need plane.sampler uniform or prioritized, "
                f"got {pc.sampler!r}"
            )
        return pc.sampler
    pr = pc.prioritized
    return Prioritized(alpha=pr.alpha, beta=pr.beta, eps=pr.eps, sequence=seq)


def grad_sync(cfg: TrainConfig, learners: list[int]) -> str:
    """``algo.grad_sync`` resolved (``none`` with a single learner).

    Raises:
        ConfigError: on ``round`` where a one-exchange plane cannot run.
    """
    pc = cfg.plane
    if len(learners) < 2:
        return "none"
    fusable = (
        pc.kind == "conduit"
        and placement(cfg) == "local"
        and pc.sampler in ("uniform", "prioritized")
        and cfg.device == "cpu"
        and pc.schedule in ("sync", "auto")
    )
    if cfg.algo.grad_sync == "auto":
        return "round" if fusable else "all_to_all"
    if cfg.algo.grad_sync == "round" and not fusable:
        raise ConfigError(
            "algo.grad_sync: 'round' needs plane.kind=conduit, plane.placement local (or "
            "auto), plane.sampler uniform or prioritized, device=cpu and plane.schedule sync "
            f"(or auto); got kind={pc.kind!r}, placement={pc.placement!r}, "
            f"sampler={pc.sampler!r}, "
            f"device={cfg.device!r}, schedule={pc.schedule!r}"
        )
    return cfg.algo.grad_sync


def bandwidth(cfg: TrainConfig) -> str | BandwidthModel:
    """``calibrate`` (``plane.calibrate``), else the declared ``latency_us`` and ``gbps``."""
    pc = cfg.plane
    if pc.calibrate:
        return "calibrate"
    return BandwidthModel.declared(pc.latency_us * 1e-6, dict(pc.gbps))


def make_plane(cfg: TrainConfig, obs_dim: int, learners: list[int], sync: str, reduce_numel: int):
    """The job's ``DataPlane`` (or the single-process ``SimpleBuffer`` baseline) for DQN
    transitions of ``obs_dim`` observations; ``sync``: the resolved ``grad_sync``, whose
    ``round`` averages ``reduce_numel`` floats inside the rounds.

    Raises:
        ConfigError: on settings the plane refuses, or the baseline asked for more than
            uniform single transitions.
    """
    example = {
        "obs": torch.zeros(1, obs_dim),
        "action": torch.zeros(1, dtype=torch.int64),
        "reward": torch.zeros(1),
        "next_obs": torch.zeros(1, obs_dim),
        "done": torch.zeros(1, dtype=torch.bool),
    }
    if cfg.algo.n_step > 1:  # streams: the plane links each env's transitions
        example["env"] = torch.zeros(1, dtype=torch.int64)
        example["truncated"] = torch.zeros(1, dtype=torch.bool)
    pc = cfg.plane
    if pc.kind == "simple":
        if pc.sampler != "uniform" or cfg.algo.n_step > 1:
            raise ConfigError(
                "plane.kind: 'simple' samples single transitions uniformly; got "
                f"plane.sampler={pc.sampler!r}, algo.n_step={cfg.algo.n_step}"
            )
        return SimpleBuffer(example, pc.capacity_per_rank, cfg.seed)
    storage = Tiers(
        [(str(k), int(n)) for k, n in pc.tiers] if pc.tiers else None,
        disk_dir=pc.disk_dir,
        gbps={k: list(v) for k, v in pc.tier_gbps.items()} if pc.tier_gbps else None,
        background=pc.demote_in_background,
    )
    return DataPlane(
        ExperienceSpec.from_batch(example),
        pc.capacity_per_rank,
        seed=cfg.seed,
        sampler=sampler(cfg),
        placement=placement(cfg),
        storage=storage,
        learner_ranks=learners,
        device=cfg.device,
        schedule="sync" if sync == "round" else pc.schedule,
        max_lag=pc.max_lag,
        timeout_s=pc.timeout_s,
        strategy=pc.strategy,
        bandwidth=bandwidth(cfg),
        bandwidth_cache=pc.bandwidth_cache,
        trace=pc.trace_dir is not None,
        reduce_numel=reduce_numel if sync == "round" else 0,
    )
