"""DataPlane on real gloo process groups (2 and 3 ranks) and at world size 1."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
from dist_utils import run_ranks
from plane_helpers import assert_intact, make_batch, shard_items, spec

import conduit_dist as cd


def _ids(rank: int, it: int, n: int) -> torch.Tensor:
    return rank * 1_000_000 + it * 1_000 + torch.arange(n)


def _exactly_once(rank, world, placement):
    plane = cd.DataPlane(spec(), capacity_per_rank=1000, seed=3, placement=placement)
    put = []
    for it in range(4):
        n = 5 + 7 * rank + it  # uneven on purpose; rank 0 puts nothing in iteration 0
        if rank == 0 and it == 0:
            plane.flush()
            continue
        ids = _ids(rank, it, n)
        if it % 3 == 2:  # written in place into staging rows
            with plane.staged(n) as rows:
                for k, v in make_batch(ids).items():
                    rows[k].copy_(v)
        else:  # copied by put, or donated and packed by the round
            plane.put(make_batch(ids), donate=it % 3 == 1)
        put.append(ids)
        batch = plane.fetch(8)
        assert_intact(batch)
    plane.flush()
    plane.wait()
    held = shard_items(plane)
    assert_intact(make_batch(held))
    plane.close()
    return torch.cat(put).tolist(), held.tolist(), len(plane)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("placement", ["round_robin", "local"])
def test_every_item_lands_exactly_once_and_intact(world, placement):
    res = run_ranks(_exactly_once, world, placement)
    put = sorted(x for r in res.values() for x in r[0])
    held = sorted(x for r in res.values() for x in r[1])
    assert held == put  # exactly once: no loss, no duplicate
    assert all(r[2] == len(put) for r in res.values())
    if placement == "local":
        for p, h, _ in res.values():
            assert sorted(p) == sorted(h)
    else:
        sizes = [len(r[1]) for r in res.values()]
        assert max(sizes) - min(sizes) <= 1  # round robin fills evenly


def _fifo(rank, world):
    plane = cd.DataPlane(spec(), capacity_per_rank=10, seed=0, placement="local")
    for it in range(5):
        plane.put(make_batch(_ids(rank, it, 4)))
        plane.flush()
    plane.wait()
    held = sorted(shard_items(plane).tolist())
    plane.close()
    return held, len(plane)


def test_fifo_overwrites_oldest_first():
    res = run_ranks(_fifo, 2)
    for rank, (held, total) in res.items():
        newest = torch.cat([_ids(rank, it, 4) for it in range(5)])[-10:]
        assert held == sorted(newest.tolist())
        assert total == 20


def _sample_counts(rank, world, sizes, rounds, batch):
    plane = cd.DataPlane(spec(), capacity_per_rank=100, seed=11, placement="local")
    plane.put(make_batch(_ids(rank, 0, sizes[rank])))
    plane.flush()
    seen = []
    for _ in range(rounds):
        b = plane.fetch(batch, oversample=True)
        assert_intact(b)
        seen.append(b["id"].clone())
    plane.close()
    return torch.cat(seen).tolist()


def test_uniform_over_uneven_shards_chi_square():
    from scipy.stats import chisquare

    sizes = [40, 12, 3]
    res = run_ranks(_sample_counts, 3, sizes, 40, 96)
    all_ids = [i for r in range(3) for i in _ids(r, 0, sizes[r]).tolist()]
    for rank, seen in res.items():
        counts = np.array([seen.count(i) for i in all_ids])
        assert counts.sum() == 40 * 96
        p = chisquare(counts).pvalue
        assert p > 1e-3, f"rank {rank}: sampling not uniform over the global store (p={p:.2e})"
    # a deliberately biased sampler (uniform over shards, not items) must fail the same test
    rng = np.random.default_rng(0)
    shard = rng.integers(0, 3, 40 * 96)
    biased = np.zeros(len(all_ids), dtype=int)
    offs = np.cumsum([0, *sizes])
    for s in shard:
        biased[offs[s] + rng.integers(0, sizes[s])] += 1
    assert chisquare(biased).pvalue < 1e-6


def _deterministic(rank, world, seed):
    plane = cd.DataPlane(spec(), capacity_per_rank=50, seed=seed)
    out = []
    for it in range(3):
        plane.put(make_batch(_ids(rank, it, 6)))
        out.append(plane.fetch(5)["id"].tolist())
    plane.close()
    return out


def test_same_seed_same_batches_other_seed_differs():
    a = run_ranks(_deterministic, 2, 5)
    b = run_ranks(_deterministic, 2, 5)
    c = run_ranks(_deterministic, 2, 6)
    assert a == b and a != c


def _weights(rank, world):
    plane = cd.DataPlane(spec(), capacity_per_rank=10, learner_ranks=[0])
    torch.manual_seed(rank)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    versions = []
    for it in range(3):
        plane.put(make_batch(_ids(rank, it, 2)))
        if rank == 0:
            with torch.no_grad():
                net[0].weight.fill_(it + 1.0)
            plane.publish_weights(net)
            plane.fetch(2)
        else:
            plane.flush()
            plane.wait()  # overlap mode: the flush's round (and its broadcast) runs in background
            versions.append(plane.pull_weights(net))
            assert float(net[0].weight[0, 0]) == it + 1.0
    if rank == 1:
        with pytest.raises(cd.ConfigError, match="actor"):
            plane.fetch(2)
        with pytest.raises(cd.SpecError, match="bytes"):
            plane.pull_weights(torch.nn.Linear(2, 2))
    plane.close()
    return versions, [t.sum().item() for t in net.state_dict().values()]


def test_weights_round_trip_with_versions():
    res = run_ranks(_weights, 2)
    assert res[1][0] == [1, 2, 3]
    assert res[0][1] == res[1][1]  # every parameter and buffer equal after the last pull


PLANE_TIMEOUT_S = 3.0


def _die_or_stall(rank, world, mode):
    plane = cd.DataPlane(
        spec(),
        capacity_per_rank=10,
        transport=cd.TransportConfig(timeout_s=PLANE_TIMEOUT_S),
    )
    for it in range(4):
        if rank == 1 and it == 2:
            if mode == "die":
                os._exit(3)
            time.sleep(2.5 * PLANE_TIMEOUT_S)  # past the 2x the assertion allows rank 0
            return "stalled"
        plane.put(make_batch(_ids(rank, it, 2)))
        t0 = time.monotonic()
        try:
            plane.fetch(2)
        except cd.RoundError as exc:
            waited = time.monotonic() - t0
            with pytest.raises(cd.RoundError, match="failed in round 2"):
                plane.put(make_batch(_ids(rank, it, 2)))
            return (exc.round, list(exc.ranks), str(exc), waited)
    return "no error"


@pytest.mark.parametrize("mode", ["die", "stall"])
def test_dead_or_stalled_rank_raises_naming_round_and_rank(mode):
    res = run_ranks(
        _die_or_stall, 2, mode, collective_timeout_s=3.0,
        expect_exit={1: 3} if mode == "die" else None,
    )  # fmt: skip
    rnd, ranks, msg, waited = res[0]
    assert rnd == 2 and "round 2" in msg
    assert ranks == [1], msg
    assert "flush()" in msg, msg  # the likely cause, for a rank that skipped its round
    # the timeout raised it (3 s), not the stalled rank coming back (7.5 s)
    assert waited < 2 * PLANE_TIMEOUT_S, msg


def test_world_size_one_in_process():
    cd.init_distributed()
    plane = cd.DataPlane(spec(), capacity_per_rank=20, seed=1)
    with pytest.raises(cd.EmptyStoreError, match="empty"):
        plane.fetch(4)
    plane.put(make_batch(torch.arange(25)))
    plane.put(make_batch(torch.arange(25, 30)), donate=True)
    b = plane.fetch(64, oversample=True)
    assert_intact(b)
    assert len(plane) == 20 and b["id"].min() >= 10
    plane.close()


def test_rejected_put_stores_nothing():
    cd.init_distributed()
    plane = cd.DataPlane(spec(), capacity_per_rank=100)
    good = make_batch(torch.arange(5))
    bad_cases = [
        {k: v for k, v in good.items() if k != "done"},
        {**good, "obs": good["obs"].double()},
        {**good, "obs": good["obs"][:, :2]},
        {**good, "reward": good["reward"][:3]},
        {k: v[:0] for k, v in good.items()},
        {**good, "obs": good["obs"].clone().fill_(float("nan"))},
    ]
    for bad in bad_cases:
        with pytest.raises(cd.SpecError):
            plane.put(bad)
    plane.flush()
    plane.wait()
    assert len(plane) == 0
    plane.put(good)
    late_nan = make_batch(torch.arange(5, 10))
    late_nan["reward"][-1] = float("inf")  # found mid-copy: rows already written stay invisible
    with pytest.raises(cd.SpecError, match="'reward'.*1 NaN/inf"):
        plane.put(late_nan)
    plane.flush()
    plane.wait()
    assert sorted(shard_items(plane).tolist()) == list(range(5))
    plane.close()


def test_rejected_staged_block_stages_nothing():
    cd.init_distributed()
    plane = cd.DataPlane(spec(), capacity_per_rank=100)
    good = make_batch(torch.arange(5))

    def fill(rows, batch):
        for k, v in batch.items():
            rows[k].copy_(v)

    with pytest.raises(cd.SpecError, match="'obs'"), plane.staged(5) as rows:
        fill(rows, {**good, "obs": good["obs"].clone().fill_(float("nan"))})
    with pytest.raises(KeyError), plane.staged(5) as rows:  # the producer fails inside the block
        fill(rows, good)
        raise KeyError("env crashed")
    with pytest.raises(cd.ConfigError, match="inside a staged"), plane.staged(5):
        plane.put(good)
    with pytest.raises(cd.ConfigError, match="close: cannot run inside a staged"), plane.staged(5):
        plane.close()
    with pytest.raises(cd.ConfigError, match="n must be an int >= 1, got 0"), plane.staged(0):
        pass
    plane.flush()
    plane.wait()
    assert len(plane) == 0
    with plane.staged(5) as rows:
        fill(rows, good)
    plane.put(make_batch(torch.arange(5, 8)))
    plane.flush()
    plane.wait()
    assert sorted(shard_items(plane).tolist()) == list(range(8))
    assert_intact(plane.fetch(16, oversample=True))
    plane.close()


def test_bad_constructor_arguments_name_the_field():
    cd.init_distributed()
    with pytest.raises(cd.ConfigError, match="capacity_per_rank.*got 0"):
        cd.DataPlane(spec(), capacity_per_rank=0)
    with pytest.raises(cd.ConfigError, match="placement.*'nearest'"):
        cd.DataPlane(spec(), capacity_per_rank=4, placement="nearest")
    with pytest.raises(cd.ConfigError, match="learner_ranks.*\\[5\\]"):
        cd.DataPlane(spec(), capacity_per_rank=4, learner_ranks=[5])


def test_a_plane_is_a_context_manager_that_closes_also_when_the_block_raises():
    with cd.DataPlane(spec(), capacity_per_rank=16) as plane:
        plane.put(make_batch(torch.arange(4)))
        assert plane.fetch(2)["id"].shape == (2,)
    assert plane.closed
    with pytest.raises(RuntimeError, match="closed"):
        plane.put(make_batch(torch.arange(1)))
    with pytest.raises(KeyError, match="boom"), cd.DataPlane(spec(), 16) as other:
        raise KeyError("boom")
    assert other.closed
    assert issubclass(cd.CheckpointError, RuntimeError)  # exported with the other errors
