"""Tiers: kinds round-trip; a host + disk shard keeps FIFO order, capacity and exact sampling."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from plane_helpers import assert_intact, make_batch, spec

import conduit_dist as cd
from conduit_dist.tiers import DiskTier, MemoryTier, TieredShard


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_tier_kinds_round_trip_records(kind, tmp_path):
    tier = MemoryTier(10, 16) if kind == "host" else DiskTier(10, 16, str(tmp_path))
    recs = torch.randint(0, 255, (4, 16), dtype=torch.uint8)
    tier.write(3, recs)
    out = torch.empty(2, 16, dtype=torch.uint8)
    tier.gather(torch.tensor([5, 3]), out)
    assert torch.equal(out, recs[[2, 0]])
    tier.close()
    if kind == "disk":
        assert not os.listdir(tmp_path)  # the file is removed on close


def _ids(shard: TieredShard) -> list[list[int]]:
    """Ids held by each tier, oldest first."""
    s = spec()
    per_tier = []
    for ring in shard.rings:
        phys = (ring.start + torch.arange(ring.size)) % ring.cap
        per_tier.append(s.unpack(ring.tier.data.index_select(0, phys))["id"].tolist())
    return per_tier


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 23), min_size=1, max_size=12), st.integers(1, 7))
def test_capacity_never_exceeded_and_fifo_across_tiers(tmp_path_factory, batches, fetch):
    cd.init_distributed()
    d = str(tmp_path_factory.mktemp("disk"))
    plane = cd.DataPlane(spec(), 17, tiers=[("host", 5), ("disk", 12)], disk_dir=d)
    written = 0
    for n in batches:
        ids = torch.arange(written, written + n)
        plane.put(make_batch(ids))
        written += n
        assert_intact(plane.fetch(fetch))
        tiers = _ids(plane.shard)
        assert all(r.size <= r.cap for r in plane.shard.rings)
        newest = list(range(max(0, written - 17), written))
        assert [i for t in reversed(tiers) for i in t] == newest  # FIFO over host then disk
        assert len(plane) == len(newest)
    stats = plane.store_stats()
    assert [t["kind"] for t in stats["tiers"]] == ["host", "disk"]
    assert stats["evictions"] == max(0, written - 17)
    plane.close()
    assert not os.listdir(d)


def test_sampling_stays_exact_across_tiers(tmp_path):
    from scipy.stats import chisquare

    cd.init_distributed()
    plane = cd.DataPlane(spec(), 40, tiers=[("host", 8), ("disk", 32)], disk_dir=str(tmp_path))
    plane.put(make_batch(torch.arange(50)))  # 10 evicted, 8 on host, 32 demoted to disk
    seen = torch.cat([plane.fetch(200)["id"] for _ in range(40)])
    counts = np.bincount(seen.numpy() - 10, minlength=40)
    assert seen.min() >= 10 and counts.sum() == 8000
    assert chisquare(counts).pvalue > 1e-3
    stats = plane.store_stats()
    assert stats["demotions"] >= 32 and [t["items"] for t in stats["tiers"]] == [8, 32]
    plane.close()


def test_bad_tier_configurations_are_named():
    cd.init_distributed()
    with pytest.raises(cd.ConfigError, match=r"add up to 12, expected capacity_per_rank=10"):
        cd.DataPlane(spec(), 10, tiers=[("host", 4), ("host", 8)])
    with pytest.raises(cd.ConfigError, match="'tape'"):
        cd.DataPlane(spec(), 10, tiers=[("tape", 10)])
    with pytest.raises(cd.ConfigError, match="disk_dir"):
        cd.DataPlane(spec(), 10, tiers=[("host", 5), ("disk", 5)])
    if not torch.cuda.is_available():
        with pytest.raises(cd.ConfigError, match="CUDA"):
            cd.DataPlane(spec(), 10, tiers=[("pinned", 10)])
