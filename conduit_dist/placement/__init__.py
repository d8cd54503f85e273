"""Placement policies: the protocol in ``base.py``, one module per kind."""

from conduit_dist.placement.bandwidth_aware import BandwidthAware, plan_near_learners
from conduit_dist.placement.base import Placement, PlacementContext
from conduit_dist.placement.local import Local
from conduit_dist.placement.packed import plan_packed
from conduit_dist.placement.round_robin import RoundRobin, spread

__all__ = [
    "BandwidthAware",
    "Local",
    "Placement",
    "PlacementContext",
    "RoundRobin",
    "plan_near_learners",
    "plan_packed",
    "spread",
]
