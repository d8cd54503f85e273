"""What a ``TrainConfig`` asks of the data plane: the device, learner ranks, placement, sampler,
how learners average gradients, and the plane itself (functions of the config and the world, the
same on every rank). Both trainers build their plane with :func:`build_plane`; what differs
between them (the items' spec, the sampler, ``max_policy_age``, DQN's in-round gradient
averaging) is passed in. The device is resolved once, by :func:`device`, and passed on as a
``torch.device``."""

from __future__ import annotations

import torch

from conduit_dist.collectives.dist import resolve_device
from conduit_dist.collectives.model import BandwidthModel
from conduit_dist.errors import ConfigError
from conduit_dist.plane import DataPlane, TransportConfig
from conduit_dist.records.spec import ExperienceSpec
from conduit_dist.registry import PLACEMENTS
from conduit_dist.rl.buffers import SimpleBuffer
from conduit_dist.rounds.devices import DevicePlan, plan_devices
from conduit_dist.sampling import Prioritized, Sampler, Windows, WithoutReplacement
from conduit_dist.tiers import Tiers
from conduit_dist.train.config import TrainConfig


def device(cfg: TrainConfig) -> torch.device:
    """``cfg.device`` resolved once: ``cpu`` or ``cuda:<index>`` (``resolve_device``), the
    ``torch.device`` every part of the job is then given.

    Args:
        cfg: the run config.

    Returns:
        The device.

    Raises:
        ConfigError: on a device that is not ``cpu``/``cuda``/``cuda:<index>``, or CUDA on a
            machine (or a torch build) without it, naming the torch build.
    """
    return resolve_device(cfg.device)


def learner_ranks(cfg: TrainConfig, world: int) -> list[int]:
    """Every rank colocated (and with GRPO's generators attached from outside the job);
    ``cfg.learner_ranks`` disaggregated.

    Raises:
        ConfigError: without an actor or a learner, or on ranks outside the world.
    """
    if cfg.mode == "colocated":
        return list(range(world))
    if cfg.algo.name == "grpo" and cfg.algo.grpo.generators == "attached":
        return list(range(world))  # generators are outside the job: every rank learns
    if cfg.algo.name == "dqn" and cfg.algo.actors == "attached":
        return list(range(world))  # so are the actors
    learners = sorted(set(cfg.learner_ranks))
    if world < 2 or not learners or len(learners) >= world:
        raise ConfigError(
            f"learner_ranks: disaggregated mode needs learners and at least one actor among "
            f"{world} ranks, got {list(cfg.learner_ranks)}"
        )
    if any(not 0 <= r < world for r in learners):
        raise ConfigError(f"learner_ranks: expected ranks in 0..{world - 1}, got {learners}")
    return learners


def sampler_name(cfg: TrainConfig) -> str:
    """``plane.sampler`` with ``auto`` resolved: ``without_replacement`` for PPO (each rollout
    is read ``algo.ppo.epochs`` times, then dropped), ``uniform`` for DQN.

    Args:
        cfg: the run config.

    Returns:
        A name from ``registry.SAMPLERS``.
    """
    if cfg.plane.sampler != "auto":
        return cfg.plane.sampler
    return "without_replacement" if cfg.algo.name == "ppo" else "uniform"


def placement(cfg: TrainConfig) -> str:
    """``plane.placement`` with ``auto`` resolved: ``local`` for PPO (each rollout stays on the
    rank that collected it until the learners' minibatch rounds read it) and for colocated DQN
    (one exchange a round); else ``round_robin`` (DQN disaggregated: ``local`` would leave the
    learners' shards empty, so the store would hold only the actors' capacity; n-step windows
    are dealt by stream).

    Args:
        cfg: the run config.

    Returns:
        A name from ``registry.PLACEMENTS``.
    """
    if cfg.plane.placement != "auto":
        return cfg.plane.placement
    if cfg.algo.name == "ppo" or cfg.mode == "colocated":
        return "local"
    return "round_robin"


def sampler(cfg: TrainConfig) -> str | Sampler:
    """The sampler ``cfg`` asks for. PPO: ``WithoutReplacement(epochs, shuffle)`` from
    ``algo.ppo``. DQN: ``plane.sampler`` as a name, or a ``Prioritized`` built from
    ``plane.prioritized`` (with ``algo.n_step > 1`` n-step windows over each env's stream;
    uniform sampling of them is ``Prioritized`` with ``alpha = 0``).

    Args:
        cfg: the run config.

    Returns:
        A name from ``registry.SAMPLERS`` or a new (unbound) sampler.

    Raises:
        ConfigError: for PPO, on a ``plane.sampler`` other than ``auto`` or
            ``without_replacement``; for DQN, on n-step windows with a sampler other than
            uniform or prioritized.
    """
    if cfg.algo.name == "ppo":
        return _ppo_sampler(cfg)
    pc, algo, name = cfg.plane, cfg.algo, sampler_name(cfg)
    seq = None
    if algo.n_step > 1:
        seq = Windows(
            n_step=algo.n_step, gamma=algo.gamma, done="done", truncated="truncated",
            stream="env",
        )  # fmt: skip
        if name == "uniform":
            return Prioritized(alpha=0.0, beta=0.0, eps=0.0, sequence=seq)
    if name != "prioritized":
        if seq is not None:
            raise ConfigError(
                f"algo.n_step: n-step windows need plane.sampler uniform or prioritized, "
                f"got {pc.sampler!r}"
            )
        return name
    pr = pc.prioritized
    return Prioritized(alpha=pr.alpha, beta=pr.beta, eps=pr.eps, sequence=seq)


def _ppo_sampler(cfg: TrainConfig) -> WithoutReplacement:
    p = cfg.algo.ppo
    if sampler_name(cfg) != "without_replacement":
        raise ConfigError(
            f"plane.sampler: PPO reads each rollout algo.ppo.epochs={p.epochs} times and then "
            "drops it, which is WithoutReplacement(algo.ppo.epochs, algo.ppo.shuffle); "
            f"expected 'auto' (or 'without_replacement'), got {cfg.plane.sampler!r}"
        )
    return WithoutReplacement(epochs=p.epochs, shuffle=p.shuffle)


def check_ppo(cfg: TrainConfig) -> None:
    """Refuse the ``plane`` settings PPO cannot honour (``plane.sampler``: :func:`sampler`).

    Args:
        cfg: the run config (``algo.name == "ppo"``).

    Raises:
        ConfigError: on ``plane.kind=simple`` or ``plane.early_start=true``, naming the setting,
            the received value and what PPO needs.
    """
    pc = cfg.plane
    if pc.kind != "conduit":
        raise ConfigError(
            "plane.kind: PPO needs the sharded data plane ('conduit'): the single-process "
            "baseline samples single transitions uniformly, with no epochs over a rollout and "
            f"no policy versions; got {pc.kind!r}"
        )
    if pc.early_start is True:
        raise ConfigError(
            "plane.early_start: PPO's minibatch rounds already run behind the previous "
            "backward (fetch(..., more=True) with plane.max_lag=0); early start is DQN's "
            "algo.grad_sync=round path; expected auto or false, got true"
        )


def grad_sync(cfg: TrainConfig, learners: list[int], dev: torch.device | None = None) -> str:
    """``algo.grad_sync`` resolved (``none`` with a single learner). ``auto`` is ``round`` where
    the round is one exchange anyway (``local`` placement): the gradients ride the round, on the
    plane's group (on the host in the header exchange on a CPU plane; all-reduced on the GPU by
    NCCL on a CUDA plane, so the job uses one communicator). Elsewhere DDP: ``all_to_all`` on
    the CPU (gloo's latency trick for small buckets), ``allreduce`` on the GPU.

    Args:
        cfg: the run config.
        learners: the learner ranks.
        dev: the resolved device (:func:`device`; ``None``: read from ``cfg.device``).

    Returns:
        ``none``, ``round``, ``all_to_all`` or ``allreduce``.

    Raises:
        ConfigError: on ``round`` where the rounds cannot carry the gradients (a payload is
            averaged in rounds run inside ``fetch``, of the sharded plane), naming the settings
            received and those it needs.
    """
    pc = cfg.plane
    if len(learners) < 2:
        return "none"
    where = dev if dev is not None else torch.device(cfg.device)
    can = pc.kind == "conduit" and pc.schedule in ("sync", "auto")
    if cfg.algo.grad_sync == "auto":
        if can and placement(cfg) == "local":
            return "round"
        return "all_to_all" if where.type == "cpu" else "allreduce"
    if cfg.algo.grad_sync == "round" and not can:
        raise ConfigError(
            "algo.grad_sync: 'round' averages the gradients in the plane's rounds, which run "
            "inside fetch: expected plane.kind=conduit and plane.schedule sync (or auto); got "
            f"kind={pc.kind!r}, schedule={pc.schedule!r}. Use algo.grad_sync=auto, all_to_all "
            "or allreduce (DDP) otherwise"
        )
    return cfg.algo.grad_sync


def early_start(cfg: TrainConfig, grad_sync: str) -> bool:
    """``plane.early_start`` resolved for DQN: whether each round starts right after the
    backward (``fetch_start``, the gradients in its payload) and finishes at the next fetch.

    It needs a one-exchange round that carries the gradients: ``grad_sync`` ``round``, one
    update per iteration, ``max_lag=1`` (puts run while the round flies) and ``local``
    placement. ``auto`` turns it on exactly where all of these hold (the default colocated
    job), else off; ``true`` refuses a run where one does not.

    Args:
        cfg: the run config (``algo.name == "dqn"``).
        grad_sync: the resolved ``algo.grad_sync`` (:func:`grad_sync`).

    Returns:
        Whether the trainer starts rounds early.

    Raises:
        ConfigError: on ``true`` with a setting it needs unmet, naming each, the received
            and the expected value.
    """
    want = cfg.plane.early_start
    if want is False:
        return False
    need = {
        "algo.grad_sync": ("round", grad_sync),
        "algo.updates_per_iter": (1, cfg.algo.updates_per_iter),
        "plane.max_lag": (1, cfg.plane.max_lag),  # puts run while the started round flies
        "plane.placement": ("local", placement(cfg)),  # one exchange to leave in flight
    }
    bad = [f"{k}={got!r} (expected {exp!r})" for k, (exp, got) in need.items() if exp != got]
    if bad and want is True:
        raise ConfigError(
            "plane.early_start: needs a one-exchange round to start early; got " + ", ".join(bad)
        )
    return not bad


def device_plan(cfg: TrainConfig, world: int, dev: torch.device | None = None) -> DevicePlan:
    """Where the job's ``DataPlane`` puts its tiers, rows and collectives, from the config alone
    (``rounds.devices.plan_devices``: the function the plane itself calls), with no GPU and no
    process group: ``device=cuda`` reads as ``cuda:0`` here unless ``dev`` is given.

    Args:
        cfg: the run config (DQN or PPO; GRPO's token plane has its own transport).
        world: ranks in the job.
        dev: the resolved device (default: ``cfg.device``, a bare ``cuda`` as ``cuda:0``).

    Returns:
        The plan (``DevicePlan``).

    Raises:
        ConfigError: for ``algo.name=grpo`` (``cd.TokenPlane``), or settings the plane refuses.
    """
    if cfg.algo.name == "grpo":
        raise ConfigError(
            "device_plan: algo.name=grpo runs a cd.TokenPlane, which has its own transport; "
            "expected dqn or ppo"
        )
    where = dev if dev is not None else torch.device(cfg.device)
    if where.type == "cuda" and where.index is None:
        where = torch.device("cuda", 0)
    learners = learner_ranks(cfg, world)
    sync = grad_sync(cfg, learners, where) if cfg.algo.name == "dqn" else "none"
    placed = PLACEMENTS[placement(cfg)]()
    return plan_devices(
        device=where, world=world, sampler=sampler(cfg), keeps_local=placed.keeps_local,
        first_tier=storage(cfg).first_device(where), reduce_numel=1 if sync == "round" else 0,
        rehearse=False,
    )  # fmt: skip


def bandwidth(cfg: TrainConfig) -> str | BandwidthModel:
    """``calibrate`` (``plane.calibrate``), else the declared ``latency_us`` and ``gbps``."""
    pc = cfg.plane
    if pc.calibrate:
        return "calibrate"
    return BandwidthModel.declared(pc.latency_us * 1e-6, dict(pc.gbps))


def storage(cfg: TrainConfig) -> Tiers:
    """The shard's tiers: ``plane.tiers``, ``disk_dir``, ``tier_gbps``, ``demote_in_background``.

    Args:
        cfg: the run config.

    Returns:
        The ``Tiers`` each rank's shard is built from (one memory tier when ``plane.tiers``
        is null).
    """
    pc = cfg.plane
    return Tiers(
        [(str(k), int(n)) for k, n in pc.tiers] if pc.tiers else None,
        disk_dir=pc.disk_dir,
        gbps={k: list(v) for k, v in pc.tier_gbps.items()} if pc.tier_gbps else None,
        background=pc.demote_in_background,
    )


def build_plane(
    cfg: TrainConfig,
    spec: ExperienceSpec,
    learners: list[int],
    sampler: str | Sampler,
    *,
    dev: torch.device | None = None,
    reduce_numel: int = 0,
    max_policy_age: int | None = None,
) -> DataPlane:
    """The job's ``DataPlane`` from the ``plane`` group, for either trainer: capacity,
    placement (:func:`placement`), storage tiers (:func:`storage`), schedule, lag, timeout,
    strategy, bandwidth (:func:`bandwidth`) and trace.

    Collective: every rank calls it at the same point.

    Args:
        cfg: the run config.
        spec: the fields of the trainer's items.
        learners: the learner ranks (:func:`learner_ranks`).
        sampler: the trainer's sampler (:func:`sampler`).
        dev: where batches are delivered, resolved (:func:`device`; ``None``: resolved here).
        reduce_numel: floats each round averages over the learners (DQN's
            ``algo.grad_sync=round``; 0: none). Non-zero runs the rounds ``sync`` inside fetch
            whatever ``plane.schedule`` says: a round launched at backward would run before
            the gradients it averages exist.
        max_policy_age: the plane's bound on an item's policy age (PPO's
            ``algo.ppo.max_policy_age``; ``None``: no bound).

    Returns:
        The plane.

    Raises:
        ConfigError: on settings the plane refuses (nothing is left behind).
    """
    pc = cfg.plane
    return DataPlane(
        spec,
        pc.capacity_per_rank,
        seed=cfg.seed,
        sampler=sampler,
        placement=placement(cfg),
        storage=storage(cfg),
        learner_ranks=learners,
        device=dev if dev is not None else device(cfg),
        schedule="sync" if reduce_numel else pc.schedule,
        max_lag=pc.max_lag,
        transport=TransportConfig(
            timeout_s=pc.timeout_s,
            strategy=pc.strategy,
            bandwidth=bandwidth(cfg),
            bandwidth_cache=pc.bandwidth_cache,
            shared_memory=pc.shared_memory,
            weights_bucket_mb=pc.weights_bucket_mb,
        ),
        trace=pc.trace_dir is not None,
        reduce_numel=reduce_numel,
        max_policy_age=max_policy_age,
    )


def make_plane(
    cfg: TrainConfig,
    obs_dim: int,
    learners: list[int],
    sync: str,
    reduce_numel: int,
    dev: torch.device | None = None,
) -> DataPlane | SimpleBuffer:
    """DQN's ``DataPlane`` (:func:`build_plane`), or the single-process ``SimpleBuffer``
    baseline, for transitions of ``obs_dim`` observations.

    Args:
        cfg: the run config (``algo.name == "dqn"``).
        obs_dim: observation width.
        learners: the learner ranks.
        sync: the resolved ``grad_sync`` (:func:`grad_sync`); ``round`` averages
            ``reduce_numel`` floats inside the rounds.
        reduce_numel: the flat gradient's size.
        dev: where batches are delivered, resolved (:func:`device`; ``None``: resolved here).

    Returns:
        The plane, or the baseline for ``plane.kind=simple``.

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
    pc, dev = cfg.plane, dev if dev is not None else device(cfg)
    if pc.kind == "simple":
        if sampler_name(cfg) != "uniform" or cfg.algo.n_step > 1:
            raise ConfigError(
                "plane.kind: 'simple' samples single transitions uniformly; got "
                f"plane.sampler={pc.sampler!r}, algo.n_step={cfg.algo.n_step}"
            )
        return SimpleBuffer(example, pc.capacity_per_rank, cfg.seed, dev)
    return build_plane(
        cfg,
        ExperienceSpec.from_batch(example),
        learners,
        sampler(cfg),
        dev=dev,
        reduce_numel=reduce_numel if sync == "round" else 0,
    )
