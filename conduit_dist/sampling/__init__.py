"""Samplers over the sharded store."""

from conduit_dist.sampling.uniform import UniformSampler, allocate

__all__ = ["UniformSampler", "allocate"]
