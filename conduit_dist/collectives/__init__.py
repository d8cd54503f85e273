"""Process groups and the data plane's collectives (names re-exported explicitly)."""

from conduit_dist.collectives.dist import destroy_distributed as destroy_distributed
from conduit_dist.collectives.dist import get_rank as get_rank
from conduit_dist.collectives.dist import get_world_size as get_world_size
from conduit_dist.collectives.dist import init_distributed as init_distributed
from conduit_dist.collectives.dist import is_rank_zero as is_rank_zero
from conduit_dist.collectives.exchange import Exchange as Exchange
