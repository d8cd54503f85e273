"""Memory tiers, the per-rank shard and placement."""

from conduit_dist.tiers.base import Tier
from conduit_dist.tiers.memory import MemoryTier
from conduit_dist.tiers.placement import POLICIES, plan_ingest
from conduit_dist.tiers.shard import Shard

__all__ = ["POLICIES", "MemoryTier", "Shard", "Tier", "plan_ingest"]
