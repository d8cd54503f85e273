"""Samplers over the sharded store: the core protocol and the capability protocols in
``base.py``, one module per kind."""

from conduit_dist.sampling.base import (
    KeepsItemState,
    ReportsMeta,
    RoutesFeedback,
    Sampler,
    SamplerContext,
    Speculative,
    Streams,
    Takes,
    TracksInflow,
    WritesRows,
)
from conduit_dist.sampling.epochs import WithoutReplacement
from conduit_dist.sampling.prioritized import Prioritized
from conduit_dist.sampling.queue import Lifo, Queue
from conduit_dist.sampling.sequences import Sequence
from conduit_dist.sampling.stratified import Stratified
from conduit_dist.sampling.uniform import Uniform

__all__ = [
    "KeepsItemState",
    "Lifo",
    "Prioritized",
    "Queue",
    "ReportsMeta",
    "RoutesFeedback",
    "Sampler",
    "SamplerContext",
    "Sequence",
    "Speculative",
    "Stratified",
    "Streams",
    "Takes",
    "TracksInflow",
    "Uniform",
    "WithoutReplacement",
    "WritesRows",
]
