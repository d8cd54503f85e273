"""DataPlane: the public put / fetch / flush / weights API over a sharded experience store."""

from conduit_dist.plane.core import DataPlane
from conduit_dist.plane.options import TransportConfig
from conduit_dist.rounds.tickets import RoundStats

__all__ = ["DataPlane", "RoundStats", "TransportConfig"]
