"""conduit_dist: a distributed experience data plane for reinforcement learning.

Public API::

    import conduit_dist as cd
    cd.init_distributed()
    spec = cd.ExperienceSpec.from_batch(batch)
    plane = cd.DataPlane(spec, capacity_per_rank=100_000, seed=0, sampler=cd.Uniform())
    plane.put(batch)
    sample = plane.fetch(256)
"""

from conduit_dist.attach import AttachedProducer, attach
from conduit_dist.collectives import (
    destroy_distributed,
    get_rank,
    get_world_size,
    init_distributed,
    is_rank_zero,
)
from conduit_dist.collectives.model import BandwidthModel
from conduit_dist.errors import (
    CheckpointError,
    ConfigError,
    EmptyStoreError,
    PhaseError,
    RateLimitError,
    RoundError,
    SpecError,
    StaleDataError,
)
from conduit_dist.flow.ratelimit import RateLimiter
from conduit_dist.integrations.loader import ExperienceLoader, ExperienceWriter
from conduit_dist.placement import BandwidthAware, Local, Placement, RoundRobin
from conduit_dist.plane import DataPlane, RoundStats, TransportConfig
from conduit_dist.records.spec import ExperienceSpec, FieldSpec
from conduit_dist.sampling import Prioritized, Sampler, Uniform, Windows, WithoutReplacement
from conduit_dist.sampling.queue import Fifo, Lifo
from conduit_dist.sampling.stratified import Stratified
from conduit_dist.tiers import Tiers
from conduit_dist.tokens import MicroBatch, Ragged, TokenPlane, TokenSpec

__all__ = [
    "AttachedProducer",
    "BandwidthAware",
    "BandwidthModel",
    "CheckpointError",
    "ConfigError",
    "DataPlane",
    "EmptyStoreError",
    "ExperienceLoader",
    "ExperienceSpec",
    "ExperienceWriter",
    "FieldSpec",
    "Fifo",
    "Lifo",
    "Local",
    "MicroBatch",
    "PhaseError",
    "Placement",
    "Prioritized",
    "Ragged",
    "RateLimitError",
    "RateLimiter",
    "RoundError",
    "RoundRobin",
    "RoundStats",
    "Sampler",
    "SpecError",
    "StaleDataError",
    "Stratified",
    "Tiers",
    "TokenPlane",
    "TokenSpec",
    "TransportConfig",
    "Uniform",
    "Windows",
    "WithoutReplacement",
    "attach",
    "destroy_distributed",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_rank_zero",
]

__version__ = "0.1.0"


def __getattr__(name: str):
    """``cd.ShardedReplayBuffer``, imported on first use (the ``[torchrl]`` extra: tensordict)."""
    if name == "ShardedReplayBuffer":
        from conduit_dist.integrations.torchrl import ShardedReplayBuffer

        return ShardedReplayBuffer
    raise AttributeError(f"module 'conduit_dist' has no attribute {name!r}")
