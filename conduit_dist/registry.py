"""One table of allowed values per setting, shared by the constructor and the Hydra config.

A new sampler or placement is one module in its subpackage plus one line here; ``config.validate``
and :class:`~conduit_dist.plane.DataPlane` both resolve names through these tables, so an unknown
value is the same clear error everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

import numpy as np

from conduit_dist.collectives.strategies import NAMES as STRATEGY_NAMES
from conduit_dist.errors import ConfigError
from conduit_dist.placement import BandwidthAware, Local, Placement, RoundRobin
from conduit_dist.sampling import Prioritized, Sampler, SamplerContext, Takes, Uniform
from conduit_dist.sampling.epochs import SHUFFLES as _SHUFFLES
from conduit_dist.sampling.epochs import WithoutReplacement
from conduit_dist.sampling.queue import Fifo, Lifo
from conduit_dist.sampling.stratified import Stratified

SAMPLERS: dict[str, Callable[[], Sampler]] = {
    "uniform": Uniform,
    "stratified": Stratified,
    "prioritized": Prioritized,
    "queue": Fifo,
    "lifo": Lifo,
    "without_replacement": WithoutReplacement,
}
PLACEMENTS: dict[str, Callable[[], Placement]] = {
    "round_robin": RoundRobin,
    "local": Local,
    "bandwidth_aware": BandwidthAware,
}
# plane.placement in train.py: ``auto`` (local; see config.PlaneConfig) or a placement above
TRAIN_PLACEMENTS = ("auto", *PLACEMENTS)
# plane.sampler in train.py: ``auto`` (DQN: uniform; PPO: without_replacement) or a sampler above
TRAIN_SAMPLERS = ("auto", *SAMPLERS)
SCHEDULES = ("overlap", "sync", "auto")
STRATEGIES = ("auto", *STRATEGY_NAMES)
BANDWIDTHS = ("declared", "calibrate")
EARLY_STARTS = ("auto", True, False)  # plane.early_start (train.setup.early_start)
# transport.shared_memory: auto = on where every rank of the plane is on one host with room in
# /dev/shm (collectives.shm.open_shared), else off, saying why
SHARED_MEMORY = ("auto", True, False)
MAX_LAGS = (0, 1)  # one round is launched ahead at most, so a batch misses one round at most
MODES = ("colocated", "disaggregated")
PLANE_KINDS = ("conduit", "simple")
ALGOS = ("dqn", "ppo", "grpo")
# algo.grpo.generators: the job's ranks generate, or processes outside it attach (docs/attach.md)
GRPO_GENERATORS = ("ranks", "attached")
GRPO_ROLES = ("job", "generator")  # algo.grpo.role: train.py as the job, or as one generator
DQN_ACTORS = ("ranks", "attached")  # algo.actors: the job's actor ranks, or processes attached
DQN_ROLES = ("job", "actor")  # algo.role: train.py as the job, or as one attached DQN actor
# how learners average gradients: in the data plane's round, or DDP with a GradSync bucket hook
GRAD_SYNCS = ("auto", "round", "allreduce", "all_to_all")
SHUFFLES = _SHUFFLES  # algo.ppo.shuffle: cd.WithoutReplacement's shuffles
LOGGERS = ("wandb", "console", "none")
LOGGER_MODES = ("offline", "online", "disabled")

T = TypeVar("T")


def check_choice(field: str, value: object, allowed) -> None:
    """Raise unless ``value`` is one of ``allowed`` (a bool matches only a bool: ``1`` is not
    ``True``, nor ``True`` ``1``).

    Raises:
        ConfigError: naming the field, the allowed values and the received one.
    """
    if not any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in allowed):
        raise ConfigError(f"{field}: expected one of {list(allowed)}, got {value!r}")


def check_count(field: str, value: object, low: int) -> None:
    """Raise unless ``value`` is an int (not a bool) ``>= low``.

    Raises:
        ConfigError: naming the field, the bound and the received value.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{field}: expected an int >= {low}, got {value!r}")


def default_placement(sampler: Sampler, learners: tuple[int, ...], world: int) -> str:
    """The placement of a plane built without one.

    ``local`` when every rank learns (a learner's items stay on its shard: rounds are one
    exchange, stratified sampling and queues read their own shard first, windows keep their
    streams), and for samplers that read each item once (``Takes``: queues, epochs), whose items
    a move at ingestion would only move twice; ``round_robin`` for replay with actors (the
    learners' shards store items too, so the store holds the whole job's capacity; streams are
    dealt whole). Every sampler runs on every placement: this is the cheaper default.
    """
    if len(learners) == world or isinstance(sampler, Takes):
        return "local"
    return "round_robin"


def bound_sampler(name: str, links: np.ndarray, seed: int = 0) -> Sampler:
    """A sampler from :data:`SAMPLERS` bound to a declared job (rank 0), for what-if pricing."""
    check_choice("sampler", name, SAMPLERS)
    sampler = SAMPLERS[name]()
    sampler.bind(SamplerContext(seed, 0, links.shape[0], links))
    return sampler


def resolve(field: str, value: str | T, table: Mapping[str, Callable[[], T]], kind: type) -> T:
    """An object from ``table`` by name, or ``value`` itself when it is already a ``kind``.

    Raises:
        ConfigError: for an unknown name or an object of another type.
    """
    if isinstance(value, kind):
        return value
    if isinstance(value, str):
        check_choice(field, value, table)
        return table[value]()
    raise ConfigError(
        f"{field}: expected a {kind.__name__} or one of {list(table)}, got {type(value).__name__}"
    )
