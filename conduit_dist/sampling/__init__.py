"""Samplers over the sharded store: the protocol in ``base.py``, one module per kind."""

from conduit_dist.sampling.base import Sampler, SamplerContext
from conduit_dist.sampling.epochs import WithoutReplacement
from conduit_dist.sampling.prioritized import Prioritized
from conduit_dist.sampling.sequences import Sequence
from conduit_dist.sampling.uniform import Uniform

__all__ = ["Prioritized", "Sampler", "SamplerContext", "Sequence", "Uniform", "WithoutReplacement"]
