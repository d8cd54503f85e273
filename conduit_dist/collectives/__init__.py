"""Process groups and the data plane's collectives."""

from conduit_dist.collectives.dist import (
    destroy_distributed,
    get_rank,
    get_world_size,
    init_distributed,
    is_rank_zero,
)
from conduit_dist.collectives.exchange import Exchange

__all__ = [
    "Exchange",
    "destroy_distributed",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_rank_zero",
]
