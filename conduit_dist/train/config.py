"""Structured config schemas, registered in Hydra's ConfigStore (a misspelled key is an error).

``conf/config.yaml`` lists ``base_config`` first in its defaults, so every YAML group file and
every command-line override is merged onto these dataclasses in struct mode. The schemas are
plain dataclasses; only :func:`register` imports Hydra (the ``[train]`` extra).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from conduit_dist import registry
from conduit_dist.errors import ConfigError
from conduit_dist.extras import require
from conduit_dist.train.grpo_config import GRPOSettings
from conduit_dist.train.progress import check as check_progress


@dataclass
class PrioritizedConfig:
    """Prioritized replay (``plane.sampler=prioritized``; see ``cd.Prioritized``).

    Attributes:
        alpha: priority exponent.
        beta: importance-weight exponent at the start.
        beta_end: ``beta`` after ``total_env_steps`` (annealed linearly).
        eps: added to every ``|TD error|`` priority.
    """

    alpha: float = 0.6
    beta: float = 0.4
    beta_end: float = 1.0
    eps: float = 1e-6


@dataclass
class PlaneConfig:
    """The data plane (both trainers build it with ``setup.build_plane``).

    Attributes:
        kind: ``conduit`` (the sharded data plane) or ``simple`` (a single-process ring buffer,
            the baseline; world size 1 and DQN only).
        capacity_per_rank: items each rank's shard holds.
        placement: ``auto`` (DQN colocated and PPO: ``local``, every item stays on the rank
            that put it, so a DQN round needs one exchange; DQN disaggregated: ``round_robin``,
            since ``local`` would leave the learners' shards empty) or a name from
            ``registry.PLACEMENTS``: ``round_robin``, ``local`` or ``bandwidth_aware``.
        early_start: ``auto`` (the default), ``true`` or ``false``; DQN only (PPO and GRPO
            refuse ``true``: their rounds already run behind the previous backward). Start each
            round right after the backward and finish it at the next fetch: the next
            environment step and ``put`` run while its exchange is in flight, on the main
            thread (a batch then holds items up to the previous iteration's ``put``). It needs
            ``algo.grad_sync=round``, one update per iteration, ``max_lag=1`` and ``local``
            placement (``setup.early_start``): ``auto`` turns it on where they hold (the
            default colocated job) and off elsewhere; ``true`` refuses a run where they do not.
        sampler: ``auto`` or a name from ``registry.SAMPLERS`` (``registry.TRAIN_SAMPLERS``).
            ``auto``: ``uniform`` for DQN, and for PPO ``without_replacement``, built from
            ``algo.ppo`` (``epochs``, ``shuffle``); PPO refuses any other sampler. DQN:
            ``uniform`` (each learner's batch i.i.d. over the global store), ``stratified``
            (proportional over shards, read local-first) or ``prioritized`` (prioritized replay
            exact over the global store, settings in ``prioritized``; needs ``local``
            placement, which ``auto`` picks).
        prioritized: ``alpha``, ``beta`` (annealed linearly to ``beta_end`` over
            ``total_env_steps``) and ``eps`` of ``plane.sampler=prioritized`` (ignored with
            any other sampler).
        tiers: the shard's tiers, fastest first, as ``[[kind, items], ...]`` (kinds ``device``,
            ``pinned``, ``host``, ``disk``) adding up to ``capacity_per_rank``; ``null``: one
            memory tier.
        disk_dir: directory for disk tiers.
        demote_in_background: with several tiers, demote between rounds on a worker thread.
        tier_gbps: declared ``{kind: [read, write]}`` GB/s per tier kind (``{}``: none; on
            the command line ``+plane.tier_gbps={disk:[1.0,1.0]}``, a new key); configured
            ``tiers`` of kinds not listed are measured at start-up.
        timeout_s: seconds a collective may take before the round fails.
        schedule: ``overlap`` (rounds launched at backward start), ``sync`` (inside fetch) or
            ``auto`` (each learner tries both and keeps the faster).
        max_lag: ``1``: a fetched batch may miss one round of a rank's own puts (those made
            after its round was launched at backward); ``0``: never.
        trace_dir: write each rank's Chrome trace here at the end (``null``: no trace).
        strategy: ``auto`` (the bandwidth model chooses per exchange) or a strategy to force:
            ``all_to_all``, ``p2p``, ``chunked4``, ``gather``.
        calibrate: probe the links at start-up (cached in ``bandwidth_cache``); ``false`` uses the
            declared ``latency_us`` and ``gbps`` instead.
        bandwidth_cache: directory of calibration caches.
        latency_us: declared per-call latency (when not calibrating).
        gbps: declared bandwidth per link class ``self``, ``host``, ``net`` (GB/s).
        shared_memory: host rows between the ranks through ``/dev/shm`` instead of gloo's
            sockets: ``auto`` (the default: on where every rank is on one host with room in
            ``/dev/shm``), ``true`` (required) or ``false``.
        weights_bucket_mb: the largest piece of a weights transfer, MiB (``null``: the
            library's 64; ``TransportConfig.weights_bucket_mb``, docs/weights.md).
    """

    kind: str = "conduit"
    capacity_per_rank: int = 50_000
    placement: str = "auto"
    early_start: Any = "auto"  # auto | true | false (registry.EARLY_STARTS)
    sampler: str = "auto"
    prioritized: PrioritizedConfig = field(default_factory=PrioritizedConfig)
    tiers: list[list[Any]] | None = None
    disk_dir: str | None = None
    demote_in_background: bool = True
    # {} rather than null: OmegaConf 2.3 cannot merge a command-line dict into a null
    # Optional[Dict] node (+plane.tier_gbps={disk:[1,1]} failed with AttributeError)
    tier_gbps: dict[str, list[float]] = field(default_factory=dict)
    timeout_s: float = 60.0
    schedule: str = "auto"
    max_lag: int = 1
    trace_dir: str | None = None
    strategy: str = "auto"
    calibrate: bool = True
    bandwidth_cache: str = "~/.cache/conduit_dist"
    latency_us: float = 150.0
    gbps: dict[str, float] = field(default_factory=lambda: {"self": 8.0, "host": 1.5, "net": 0.1})
    shared_memory: Any = "auto"  # auto | true | false (registry.SHARED_MEMORY)
    weights_bucket_mb: float | None = None


@dataclass
class EnvConfig:
    """Environments each rank steps.

    Attributes:
        id: gymnasium environment id.
        num_envs: vectorized environments per acting rank.
    """

    id: str = "CartPole-v1"
    num_envs: int = 8


@dataclass
class PPOConfig:
    """PPO-specific hyperparameters (``algo=ppo``; CleanRL's ``ppo.py`` defaults).

    Attributes:
        num_steps: env steps per env in one rollout (a rollout: ``num_steps`` x ``env.num_envs``
            x acting ranks items).
        epochs: passes over each rollout.
        minibatches: minibatches per epoch (over all learners; each learner fetches
            ``rollout / minibatches / learners`` items per minibatch).
        gae_lambda: GAE lambda.
        clip_coef: surrogate (and value) clipping.
        ent_coef: entropy bonus.
        vf_coef: value loss weight.
        norm_adv: normalise advantages per minibatch.
        clip_vloss: clip the value loss.
        anneal_lr: anneal the learning rate linearly to 0 over ``total_env_steps``.
        shuffle: ``local`` (each learner permutes its own part of the rollout every epoch) or
            ``global`` (the whole rollout is permuted and dealt out every epoch).
        max_policy_age: no learner gets an item older than this many policy versions
            (``null``: no bound); 0 is strictly on-policy.
        wait_s: how long a learner's first fetch of an iteration waits for the actors'
            rollout (disaggregated: actors pull the new weights first).
    """

    num_steps: int = 128
    epochs: int = 4
    minibatches: int = 4
    gae_lambda: float = 0.95
    clip_coef: float = 0.2
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    norm_adv: bool = True
    clip_vloss: bool = True
    anneal_lr: bool = True
    shuffle: str = "local"
    max_policy_age: int | None = 0
    wait_s: float = 60.0


@dataclass
class AlgoConfig:
    """DQN hyperparameters.

    Attributes:
        name: algorithm: ``dqn``, ``ppo`` or ``grpo`` (``registry.ALGOS``).
        batch_size: items per update over all learners: each of ``n`` learners fetches
            ``batch_size / n`` and DDP averages their gradients, so one update is the same
            whatever the number of learners (``n`` must divide it).
        grad_sync: how several learners average gradients (``registry.GRAD_SYNCS``):
            ``round`` (inside the data plane's round, in the exchange that delivers the next
            batch: one collective per iteration, no DDP; the update is applied at the next
            fetch, so acting uses weights one update older; needs a one-exchange plane and
            ``plane.schedule`` ``sync`` or ``auto``, which then runs ``sync``), ``all_to_all``
            or ``allreduce`` (DDP, each bucket averaged by one ``all_to_all_single`` or by
            gloo's ring ``all_reduce``), ``auto`` (``round`` where it can run, else DDP with
            ``all_to_all`` for buckets up to 1 MiB); see ``conduit_dist/rl/grad_sync.py``. On
            a GPU the gradients stay on the device: ``round`` (averaged on the host) is refused
            there, ``auto`` is DDP.
        lr: Adam learning rate.
        gamma: discount.
        hidden: hidden layer widths of the Q-network.
        tau: soft target-update rate per learner step (1.0 = hard copy every step).
        target_every: learner steps between target updates.
        eps_start: initial exploration rate.
        eps_end: final exploration rate.
        eps_decay_steps: env steps (all ranks) over which epsilon decays linearly.
        learning_starts: env steps (all ranks) before the first update.
        updates_per_iter: learner steps per iteration.
        double_dqn: use the online network to pick the bootstrap action.
        max_grad_norm: gradient clipping norm.
        publish_every: learner steps between weight publications (disaggregated mode).
        n_step: n-step returns computed by the data plane at sampling over each env's
            transitions (never across an episode end; ``cd.Windows``); 1: one-step targets.
        ppo: PPO's own settings (``algo=ppo``; there ``lr``, ``gamma``, ``hidden``,
            ``max_grad_norm`` and ``grad_sync`` apply too).
        grpo: GRPO's own settings (``algo=grpo``; there ``lr`` and ``max_grad_norm`` apply
            too; ``train/grpo_config.py``).
        actors: DQN's actors: ``ranks`` (the job's actor ranks) or ``attached`` (with
            ``mode=disaggregated``: every rank learns and opens an ingress in ``attach_dir``;
            actors are processes outside the job, ``role=actor``; docs/attach.md).
        attach_dir: the ingresses' run directory (``actors=attached`` and ``role=actor``).
        role: ``job`` (``torchrun ... train.py``) or ``actor`` (``python train.py ...
            algo.role=actor``: one DQN actor attaching to ``attach_dir``).
    """

    name: str = "dqn"
    batch_size: int = 128
    grad_sync: str = "auto"
    lr: float = 1e-3
    gamma: float = 0.99
    hidden: list[int] = field(default_factory=lambda: [128, 128])
    tau: float = 0.01
    target_every: int = 1
    eps_start: float = 1.0
    eps_end: float = 0.01
    eps_decay_steps: int = 20_000
    learning_starts: int = 2_000
    updates_per_iter: int = 1
    n_step: int = 1
    double_dqn: bool = True
    max_grad_norm: float = 10.0
    publish_every: int = 4
    actors: str = "ranks"
    attach_dir: str | None = None
    role: str = "job"
    ppo: PPOConfig = field(default_factory=PPOConfig)
    grpo: GRPOSettings = field(default_factory=GRPOSettings)


@dataclass
class LoggerConfig:
    """Metrics.

    Attributes:
        kind: ``wandb`` (W&B, the console display and the metrics file), ``console`` (the
            console display and the metrics file) or ``none`` (the metrics file only). Every
            kind writes ``RUN_DIR/metrics.jsonl`` and ``RUN_DIR/run.json`` on rank 0 (read by
            ``python -m conduit_dist.report RUN_DIR``).
        mode: W&B mode: ``offline`` (default), ``online`` or ``disabled``.
        project: W&B project.
        log_every: iterations between aggregated metric logs.
        summary_path: rank 0 writes the run's summary here as JSON at the end (env steps,
            wall and time to the target, env steps/s, the per-iteration breakdown of
            ``rl/breakdown.py``); ``null``: not written.
        progress: the console display, one of ``progress.MODES``: ``auto`` (a live bar when
            the console is a terminal, plain lines otherwise), ``bar`` or ``lines``.

    Raises:
        ConfigError: on a ``progress`` not in ``progress.MODES``.
    """

    kind: str = "wandb"
    mode: str = "offline"
    project: str = "conduit_dist"
    log_every: int = 100
    summary_path: str | None = None
    progress: str = "auto"

    def __post_init__(self) -> None:
        check_progress(self.progress)  # at composition, on every rank


@dataclass
class CheckpointConfig:
    """Checkpoints of the whole job (``conduit_dist/train/resume.py``, docs/reliability.md).

    Attributes:
        dir: where checkpoints go, one file system every rank sees (``null``: none). A job
            started with a complete checkpoint there resumes from the newest one.
        every_s: seconds between checkpoints (decided by rank 0 at log intervals; 0: off).
        every_iters: iterations between checkpoints (0: off); with ``every_s`` either one.
        keep: complete checkpoints kept.
        write_mbps: the items' rate limit in MB/s (0: none: as fast as the disk takes them,
            which keeps the writer ahead of the rounds' overwrites).
        checksum_mbps: rate limit in MB/s of the background pass that then checksums the
            written items (0: none).
    """

    dir: str | None = None
    every_s: float = 300.0
    every_iters: int = 0
    keep: int = 2
    write_mbps: float = 0.0
    checksum_mbps: float = 0.0


@dataclass
class TrainConfig:
    """The main job (``train.py``).

    Attributes:
        seed: run seed (envs, networks, sampling).
        device: ``cpu``, ``cuda`` (this rank's GPU: the only visible one, else
            ``cuda:<LOCAL_RANK>``) or ``cuda:<index>``; resolved once at start-up
            (``setup.device``), refused at once where CUDA is not available. On a GPU the
            networks, the delivered batches and the learners' gradient averaging live there
            (``algo.grad_sync=round`` is CPU-only); environments step on the host.
        total_env_steps: env steps over all ranks before stopping.
        target_return: stop early once the mean return of the last 100 episodes reaches this
            (``null``: never).
        mode: ``colocated`` (every rank acts and learns) or ``disaggregated``.
        learner_ranks: learner ranks in disaggregated mode.
    """

    seed: int = 0
    device: str = "cpu"
    total_env_steps: int = 100_000
    target_return: float | None = None
    mode: str = "colocated"
    learner_ranks: list[int] = field(default_factory=lambda: [0])
    plane: PlaneConfig = field(default_factory=PlaneConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


def validate(cfg: TrainConfig) -> None:
    """Check values a schema's types cannot express (allowed values from ``registry``).

    Raises:
        ConfigError: naming the field, the expected and the received value.
    """
    choices = [
        ("mode", cfg.mode, registry.MODES),
        ("algo.name", cfg.algo.name, registry.ALGOS),
        ("algo.grad_sync", cfg.algo.grad_sync, registry.GRAD_SYNCS),
        ("plane.kind", cfg.plane.kind, registry.PLANE_KINDS),
        ("plane.placement", cfg.plane.placement, registry.TRAIN_PLACEMENTS),
        ("plane.sampler", cfg.plane.sampler, registry.TRAIN_SAMPLERS),
        ("plane.schedule", cfg.plane.schedule, registry.SCHEDULES),
        ("plane.strategy", cfg.plane.strategy, registry.STRATEGIES),
        ("plane.max_lag", cfg.plane.max_lag, registry.MAX_LAGS),
        ("plane.early_start", cfg.plane.early_start, registry.EARLY_STARTS),
        ("plane.shared_memory", cfg.plane.shared_memory, registry.SHARED_MEMORY),
        ("logger.kind", cfg.logger.kind, registry.LOGGERS),
        ("logger.mode", cfg.logger.mode, registry.LOGGER_MODES),
        ("algo.ppo.shuffle", cfg.algo.ppo.shuffle, registry.SHUFFLES),
    ]
    for name, got, allowed in choices:
        registry.check_choice(name, got, allowed)
    pr, ck = cfg.plane.prioritized, cfg.checkpoint
    checks = [
        ("env.num_envs", cfg.env.num_envs >= 1, ">= 1", cfg.env.num_envs),
        ("algo.batch_size", cfg.algo.batch_size >= 1, ">= 1", cfg.algo.batch_size),
        ("total_env_steps", cfg.total_env_steps >= 1, ">= 1", cfg.total_env_steps),
        ("logger.log_every", cfg.logger.log_every >= 1, ">= 1", cfg.logger.log_every),
        ("algo.tau", 0 < cfg.algo.tau <= 1, "in (0, 1]", cfg.algo.tau),
        ("algo.n_step", cfg.algo.n_step >= 1, ">= 1", cfg.algo.n_step),
        (
            "plane.weights_bucket_mb",
            cfg.plane.weights_bucket_mb is None or 0 < cfg.plane.weights_bucket_mb < math.inf,
            "a finite number > 0 or null",
            cfg.plane.weights_bucket_mb,
        ),
        ("plane.prioritized.beta_end", 0 <= pr.beta_end <= 1, "in [0, 1]", pr.beta_end),
        ("algo.ppo.num_steps", cfg.algo.ppo.num_steps >= 1, ">= 1", cfg.algo.ppo.num_steps),
        ("algo.ppo.epochs", cfg.algo.ppo.epochs >= 1, ">= 1", cfg.algo.ppo.epochs),
        ("algo.ppo.minibatches", cfg.algo.ppo.minibatches >= 1, ">= 1", cfg.algo.ppo.minibatches),
        ("checkpoint.every_s", ck.every_s >= 0, ">= 0", ck.every_s),
        ("checkpoint.every_iters", ck.every_iters >= 0, ">= 0", ck.every_iters),
        ("checkpoint.keep", ck.keep >= 1, ">= 1", ck.keep),
        ("checkpoint.write_mbps", ck.write_mbps >= 0, ">= 0", ck.write_mbps),
        ("checkpoint.checksum_mbps", ck.checksum_mbps >= 0, ">= 0", ck.checksum_mbps),
    ]
    for name, ok, expected, got in checks:  # alpha, beta, eps: checked by cd.Prioritized
        if not ok:
            raise ConfigError(f"{name}: expected {expected}, got {got!r}")
    _check_dqn_attach(cfg)
    if ck.dir is not None and (cfg.plane.kind != "conduit" or cfg.algo.name != "dqn"):
        raise ConfigError(
            f"checkpoint.dir: checkpoints need plane.kind=conduit and algo=dqn, got plane.kind="
            f"{cfg.plane.kind!r}, algo={cfg.algo.name!r} (PPO and GRPO resume are not built yet)"
        )


def _check_dqn_attach(cfg: TrainConfig) -> None:
    """DQN actors outside the job: the settings that go with them, each refusal naming them.

    Raises:
        ConfigError: naming the field, the expected and the received value.
    """
    a = cfg.algo
    registry.check_choice("algo.actors", a.actors, registry.DQN_ACTORS)
    registry.check_choice("algo.role", a.role, registry.DQN_ROLES)
    attached = a.actors == "attached" or a.role == "actor"
    if not attached:
        return
    wants = [
        ("algo.name", a.name, "dqn", "attached actors run DQN (GRPO's: algo.grpo.generators)"),
        ("plane.kind", cfg.plane.kind, "conduit", "they attach to a DataPlane's ingress"),
        ("checkpoint.dir", cfg.checkpoint.dir, None, "resume with attached actors: not yet"),
        ("target_return", cfg.target_return, None, "the returns are the actors' own"),
    ]
    if a.actors == "attached":
        wants.append(("mode", cfg.mode, "disaggregated", "every rank of the job learns"))
    for name, got, expected, why in wants:
        if got != expected:
            raise ConfigError(f"{name}: expected {expected!r} with attached actors ({why}), "
                              f"got {got!r}")  # fmt: skip
    if not a.attach_dir:
        raise ConfigError(
            f"algo.attach_dir: expected the ingresses' run directory with algo.actors=attached "
            f"or algo.role=actor, got {a.attach_dir!r}"
        )


def register() -> None:
    """Register the schemas in Hydra's ConfigStore (idempotent).

    Raises:
        ModuleNotFoundError: without hydra-core (the ``[train]`` extra), saying so.
    """
    with require("train", "conduit_dist.train.config.register"):
        from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=TrainConfig)
