"""Tiers: kinds round-trip; a host + disk shard keeps FIFO order, capacity and exact sampling."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from dist_utils import run_ranks
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
@given(st.lists(st.integers(1, 23), min_size=1, max_size=12), st.integers(1, 7), st.booleans())
def test_capacity_never_exceeded_and_fifo_across_tiers(tmp_path_factory, batches, fetch, bg):
    cd.init_distributed()
    d = str(tmp_path_factory.mktemp("disk"))
    plane = cd.DataPlane(
        spec(), 17, storage=cd.Tiers([("host", 5), ("disk", 12)], disk_dir=d, background=bg)
    )
    written = size = 0
    for n in batches:
        ids = torch.arange(written, written + n)
        plane.put(make_batch(ids))
        written += n
        size = min(17, size + n)
        if bg:  # room for as many again is made after the round, evicting early once full
            size -= max(0, size + min(n, 5) - 17)
        assert_intact(plane.fetch(fetch, oversample=True))
        plane.shard.settle()
        tiers = _ids(plane.shard)
        assert all(r.size <= r.cap for r in plane.shard.rings)
        newest = list(range(written - size, written))
        assert [i for t in reversed(tiers) for i in t] == newest  # FIFO over host then disk
        assert len(plane) == len(newest)
        if bg and size:  # the next round's items fit into tier 0 without demoting in the round
            assert plane.shard.rings[0].size <= 5 - min(n, 5)
    stats = plane.store_stats()
    assert [t["kind"] for t in stats["tiers"]] == ["host", "disk"]
    assert stats["evictions"] == written - size
    plane.close()
    assert not os.listdir(d)


@pytest.mark.parametrize("bg", [False, True])
def test_sampling_stays_exact_across_tiers(tmp_path, bg):
    from scipy.stats import chisquare

    cd.init_distributed()
    plane = cd.DataPlane(
        spec(),
        40,
        storage=cd.Tiers([("host", 8), ("disk", 32)], disk_dir=str(tmp_path), background=bg),
    )
    plane.put(make_batch(torch.arange(50)))  # 10 evicted, 8 on host, 32 demoted to disk
    first = plane.fetch(200, oversample=True)["id"]
    assert first.min() >= 10
    # in the background, room for 8 more is made after that round: 8 more evicted early
    oldest = 18 if bg else 10
    assert len(plane) == 50 - oldest
    seen = torch.cat([plane.fetch(200, oversample=True)["id"] for _ in range(40)])
    counts = np.bincount(seen.numpy() - oldest, minlength=50 - oldest)
    assert seen.min() >= oldest and counts.sum() == 8000
    assert chisquare(counts).pvalue > 1e-3
    stats = plane.store_stats()
    assert stats["demotions"] >= 32
    assert [t["items"] for t in stats["tiers"]] == ([0, 32] if bg else [8, 32])
    plane.close()


def test_bad_tier_configurations_are_named():
    cd.init_distributed()
    with pytest.raises(cd.ConfigError, match=r"add up to 12, expected capacity_per_rank=10"):
        cd.DataPlane(spec(), 10, storage=cd.Tiers([("host", 4), ("host", 8)]))
    with pytest.raises(cd.ConfigError, match="'tape'"):
        cd.DataPlane(spec(), 10, storage=cd.Tiers([("tape", 10)]))
    with pytest.raises(cd.ConfigError, match="disk_dir"):
        cd.DataPlane(spec(), 10, storage=cd.Tiers([("host", 5), ("disk", 5)]))
    if not torch.cuda.is_available():
        with pytest.raises(cd.ConfigError, match="CUDA"):
            cd.DataPlane(spec(), 10, storage=cd.Tiers([("pinned", 10)]))
        with pytest.raises(cd.ConfigError, match="CUDA"):
            cd.DataPlane(spec(), 10, storage=cd.Tiers([("device", 5), ("host", 5)]))


def _replicated_sizes(rank, world, placement):
    plane = cd.DataPlane(
        spec(),
        12,
        seed=3,
        storage=cd.Tiers([("host", 4), ("host", 8)]),
        placement=placement,
        schedule="sync",
    )
    rng = np.random.default_rng(rank)
    for it in range(12):
        n = int(rng.integers(1, 9))
        plane.put(make_batch(rank * 10_000 + it * 100 + torch.arange(n)))
        assert_intact(plane.fetch(6))
        plane.shard.settle()
        mine = torch.tensor([plane.shard.size])
        every = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        torch.distributed.all_gather(every, mine)
        assert [int(t) for t in every] == plane.sizes.tolist(), (it, plane.sizes)
    plane.close()
    return plane.sizes.tolist()


@pytest.mark.parametrize("placement", ["round_robin", "local"])
def test_background_demotion_keeps_sizes_replicated_on_real_ranks(placement):
    sizes = run_ranks(_replicated_sizes, 2, placement)
    assert sizes[0] == sizes[1]


def test_tier_bandwidths_are_measured_or_declared(tmp_path):
    cd.init_distributed()
    tiers = [("host", 64), ("disk", 64)]
    plane = cd.DataPlane(spec(), 128, storage=cd.Tiers(tiers, disk_dir=str(tmp_path)))
    for t in plane.store_stats()["tiers"]:
        assert t["bandwidth_source"] == "calibrated" and t["read_gbps"] > 0 and t["write_gbps"] > 0
    assert len(plane) == 0 and int(plane.shard.rings[1].tier.data.sum()) == 0  # probe undone
    plane.close()
    plane = cd.DataPlane(
        spec(), 128, storage=cd.Tiers(tiers, disk_dir=str(tmp_path), gbps={"disk": (2.0, 1.0)})
    )
    host, disk = plane.store_stats()["tiers"]
    assert host["bandwidth_source"] == "calibrated"
    assert (disk["read_gbps"], disk["write_gbps"], disk["bandwidth_source"]) == (2.0, 1.0, "config")
    plane.close()
    with pytest.raises(cd.ConfigError, match=r"tier_gbps\['disk'\].*\(0, 1\)"):
        cd.DataPlane(
            spec(), 128, storage=cd.Tiers(tiers, disk_dir=str(tmp_path), gbps={"disk": (0, 1)})
        )
    assert not os.listdir(tmp_path)  # the failed plane left no file behind


def test_puts_write_ahead_into_free_first_tier_slots_and_stage_when_there_are_none():
    """A tiered shard reserves free slots of its first tier for puts (Storage.reserve); a put
    that does not fit is staged, and so is every put after it until the next round."""
    storage = cd.Tiers([("host", 8), ("host", 16)], gbps={"host": (1.0, 1.0)})
    plane = cd.DataPlane(spec(), 24, seed=0, storage=storage)
    stager = plane._p.stager
    plane.put(make_batch(torch.arange(5)))
    assert (stager.direct, stager.buffers.current.count) == (5, 0)  # written ahead
    plane.put(make_batch(torch.arange(5, 9)))  # 5 + 4 > 8 free slots: staged
    plane.put(make_batch(torch.arange(9, 10)))  # staged too: nothing jumps the queue
    assert (stager.direct, stager.buffers.current.count) == (5, 5)
    batch = plane.fetch(64, oversample=True)
    assert_intact(batch)
    assert set(batch["id"].tolist()) <= set(range(10))
    assert len(plane) == 10
    for k in range(6):  # the demoter makes room after every round: puts go ahead again
        # once it has run (on its thread; a put does not wait for it: under load it may not
        # have started yet, and the put is staged instead)
        plane.shard.settle()
        plane.put(make_batch(torch.arange(10 + 4 * k, 14 + 4 * k)))
        assert stager.direct == 4
        assert_intact(plane.fetch(16, oversample=True))
    # full: the demoter made room for the next round's 4 items ahead (capacity - 4 held)
    assert len(plane) == 20 and plane.store_stats()["demotions"] > 0
    plane.shard.settle()
    held = [i for tier in reversed(_ids(plane.shard)) for i in tier]
    assert held == list(range(34 - 20, 34)), held  # FIFO across both tiers, the oldest evicted
    plane.close()
