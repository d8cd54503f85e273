"""Samplers over the sharded store: the core protocol and the capability protocols in
``base.py``, one module per kind."""

from conduit_dist.sampling.base import (
    KeepsItemState,
    ReadsColumns,
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
from conduit_dist.sampling.queue import Fifo, Lifo
from conduit_dist.sampling.sequences import Windows
from conduit_dist.sampling.stratified import Stratified
from conduit_dist.sampling.uniform import Uniform

__all__ = [
    "Fifo",
    "KeepsItemState",
    "Lifo",
    "Prioritized",
    "ReadsColumns",
    "ReportsMeta",
    "RoutesFeedback",
    "Sampler",
    "SamplerContext",
    "Speculative",
    "Stratified",
    "Streams",
    "Takes",
    "TracksInflow",
    "Uniform",
    "Windows",
    "WithoutReplacement",
    "WritesRows",
]
