"""A simulator of the plane's rounds on declared machines, priced by the plane's own model.

``topology``: declared machines (``conf/topology/*.yaml``); ``rounds``: one steady-state round of
a :class:`~conduit_dist.sim.rounds.Workload`, built with the plane's placement, allocators,
candidate sizing and cost model. Not yet: validation against runs, projections, plots
(issue 30).
"""

from conduit_dist.sim.rounds import SimRound, Workload, simulate
from conduit_dist.sim.topology import SimTopology, load, names

__all__ = ["SimRound", "SimTopology", "Workload", "load", "names", "simulate"]
