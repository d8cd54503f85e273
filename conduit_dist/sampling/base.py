"""Seeding shared by samplers: every rank derives the same stream from (seed, round, ...)."""

from __future__ import annotations

import torch

_MASK = (1 << 63) - 1


def mix(*keys: int) -> int:
    """A 63-bit seed from integer keys (splitmix64 steps), stable across processes and runs."""
    h = 0x9E3779B97F4A7C15
    for k in keys:
        h = (h ^ (k & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & _MASK


def seeded(gen: torch.Generator, *keys: int) -> torch.Generator:
    """Reseed ``gen`` from ``keys`` and return it."""
    gen.manual_seed(mix(*keys))
    return gen
