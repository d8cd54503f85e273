"""Samplers over the sharded store: the protocol in ``base.py``, one module per kind."""

from conduit_dist.sampling.base import Sampler, SamplerContext
from conduit_dist.sampling.uniform import Uniform

__all__ = ["Sampler", "SamplerContext", "Uniform"]
