"""A simulator of the plane's rounds on declared machines, priced by the plane's own model.

``topology``: declared machines (``conf/topology/*.yaml``); ``rounds``: one steady-state replay
round of a :class:`~conduit_dist.sim.rounds.Workload`, built with the plane's placement,
allocators, candidate sizing and cost model; ``tokens``: one token round (LLM RL) of a
:class:`~conduit_dist.sim.tokens.TokenWorkload`, with the token plane's balanced planner and
wire sizes; ``project``: projections to 4,096 GPUs and plots (``python -m conduit_dist.bench
sim`` validates against runs here and projects; docs/sim.md).
"""

from conduit_dist.sim.rounds import SimRound, Workload, simulate
from conduit_dist.sim.tokens import TokenWorkload, simulate_tokens
from conduit_dist.sim.topology import SimTopology, load, names

__all__ = [
    "SimRound",
    "SimTopology",
    "TokenWorkload",
    "Workload",
    "load",
    "names",
    "simulate",
    "simulate_tokens",
]
