"""The header exchange's sizing functions on both of their code paths: the Python loop used up
to a few ranks and the numpy path used beyond (``rounds/wire.py``), against one reference."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conduit_dist.rounds.wire import candidates, short


def _reference(requests, shares, learners) -> np.ndarray:
    world = len(requests)
    out = np.zeros((world, world), dtype=np.int64)
    for s in range(world):
        for lr in range(world):
            r, p = int(requests[lr]), float(shares[s])
            if lr == s or not learners[lr] or r <= 0 or p <= 0:
                continue
            mean = r * p
            want = math.ceil(mean + 6.0 * math.sqrt(mean * (1.0 - p)) + 0.01 * r + 4.0)
            out[s, lr] = min(want, r)
    return out


@pytest.mark.parametrize("world", [3, 8, 9, 20, 40])
def test_candidates_match_the_reference_on_both_paths(world):
    rng = np.random.default_rng(world)
    for _ in range(20):
        requests = rng.integers(0, 300, world)
        shares = rng.random(world) * (rng.random(world) > 0.2)
        shares = shares / shares.sum() if shares.sum() else shares
        learners = rng.random(world) > 0.3
        assert np.array_equal(
            candidates(requests, shares, learners), _reference(requests, shares, learners)
        )


@pytest.mark.parametrize("world", [3, 16, 17, 40])
def test_short_matches_the_reference_on_both_paths(world):
    rng = np.random.default_rng(world)
    for _ in range(50):
        alloc = rng.integers(0, 20, (world, world))
        cand = rng.integers(0, 20, (world, world))
        want = any(
            alloc[lr, s] > cand[s, lr] for lr in range(world) for s in range(world) if s != lr
        )
        assert short(alloc, cand) == want
