"""The rate limiter over real gloo ranks: Reverb's samples-per-insert band, enforced over the
global store, each side waiting inside the round protocol."""

from __future__ import annotations

import time

import pytest
import torch
from dist_utils import run_ranks

import conduit_dist as cd
from conduit_dist.errors import ConfigError, RateLimitError

SPEC = {"id": ((), torch.int64)}


def test_min_size_holds_the_first_sample_and_names_itself():
    lim = cd.RateLimiter(min_size=8, timeout_s=0.2)
    plane = cd.DataPlane(cd.ExperienceSpec(SPEC), 32, rate_limiter=lim)
    plane.put({"id": torch.arange(5)})
    with pytest.raises(RateLimitError, match=r"min_size=8 \(5 inserted, 0 sampled, 5 stored\)"):
        plane.fetch(2)
    assert lim.sampled == 0 and plane.store_stats()["rate_blocked_sample_s"] >= 0.2
    plane.put({"id": torch.arange(5, 8)})
    assert plane.fetch(2)["id"].numel() == 2
    plane.close()


def test_samples_per_insert_decides_how_many_updates_a_colocated_iteration_runs():
    lim = cd.RateLimiter(samples_per_insert=2.0, min_size=4, error_buffer=8, timeout_s=0.2)
    plane = cd.DataPlane(cd.ExperienceSpec(SPEC), 64, rate_limiter=lim)
    updates = []
    for i in range(6):
        plane.put({"id": torch.arange(4) + 4 * i})
        plane.flush()
        n = lim.allowed(len(plane)) // 4  # every rank computes the same from replicated counts
        for _ in range(n):
            plane.fetch(4)
        updates.append(n)
        assert lim.min_diff <= lim.diff < lim.min_diff + 4
    assert sum(updates) * 4 <= 2 * 24  # never more samples than the ratio allows
    assert updates[-1] == 2  # steady state: 4 inserts x 2 samples per insert / batch 4
    with pytest.raises(RateLimitError, match="samples_per_insert=2 with error_buffer=8"):
        plane.fetch(4)
    plane.close()


def _run(rank: int, world: int) -> dict[str, object]:
    lim = cd.RateLimiter(samples_per_insert=2.0, min_size=32, error_buffer=64, timeout_s=60)
    plane = cd.DataPlane(cd.ExperienceSpec(SPEC), 512, learner_ranks=[0], rate_limiter=lim)
    diffs, target, total = [], 30 * 16, 30 * (8 + 2)
    if rank == 0:  # the learner: slower than actor 1, faster than actor 2
        for _ in range(30):
            plane.fetch(16)
            diffs.append(lim.diff)
            time.sleep(0.002)
        while lim.inserted < total:  # rounds until every actor is done (replicated counts)
            plane.flush()
            plane.wait()
    else:
        k = 8 if rank == 1 else 2  # uneven actors
        for i in range(30):
            plane.put({"id": torch.arange(k) + 1000 * i + 100_000 * rank})  # may wait in rounds
            plane.flush()
            plane.wait()
            diffs.append(lim.diff)
            time.sleep(0.005 * rank)
        while lim.sampled < target or lim.inserted < total:  # until every rank is done
            plane.flush()
            plane.wait()
    stats = plane.store_stats()
    plane.close()
    return {
        "diffs": diffs,
        "blocked": stats["rate_blocked_insert_s"] + stats["rate_blocked_sample_s"],
    }


def test_the_global_ratio_stays_in_its_band_with_actors_and_learner_at_different_speeds():
    res = run_ranks(_run, 3, timeout_s=240)
    diffs = [d for r in res.values() for d in r["diffs"]]
    # the band is [2 * 32 - 64, 2 * 32 + 64] = [0, 128]: the sampling side exactly, the insert
    # side up to one round of the other actor's puts over it (2 * 8)
    assert min(diffs) >= 0 and max(diffs) <= 128 + 16, (min(diffs), max(diffs))
    assert any(r["blocked"] > 0 for r in res.values())  # some side had to wait


def test_rate_limiter_refuses_bad_settings():
    with pytest.raises(ConfigError, match="error_buffer: expected a number >= max"):
        cd.RateLimiter(samples_per_insert=4.0)
    with pytest.raises(ConfigError, match="min_size: expected an int >= 1, got 0"):
        cd.RateLimiter(min_size=0)
    with pytest.raises(ConfigError, match="rate_limiter: expected a conduit_dist.RateLimiter"):
        cd.DataPlane(cd.ExperienceSpec(SPEC), 8, rate_limiter="fast")
