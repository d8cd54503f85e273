"""Components and their contracts: samplers, storage, staging, scheduling, state (gloo ranks)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from dist_utils import needs_native, run_ranks
from plane_helpers import assert_intact, make_batch, shard_items, spec

import conduit_dist as cd
from conduit_dist.sampling import Sampler


class Learner(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.lin(x)


def _step(model, batch):
    model(batch["obs"]).pow(2).mean().backward()


def _ids(rank: int, it: int, n: int) -> torch.Tensor:
    return rank * 1_000_000 + it * 1_000 + torch.arange(n)


# ---------------------------------------------------------------- storage: stats never race


def _big(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Items of 64 KiB whose bytes are a function of their id (demotion has work to do)."""
    frame = (ids[:, None] * 7 + torch.arange(65_536)[None, :]).remainder(251).to(torch.uint8)
    return {"id": ids, "frame": frame}


def _stats_during_rounds(rank, world, disk_dir):
    big = cd.ExperienceSpec.from_batch(_big(torch.arange(1)))
    storage = cd.Tiers([("host", 64), ("disk", 192)], disk_dir=f"{disk_dir}/{rank}")
    plane = cd.DataPlane(
        big,
        256,
        seed=1,
        storage=storage,
        schedule="overlap",
        transport=cd.TransportConfig(timeout_s=20),
    )
    model = torch.nn.Linear(4, 1)
    plane.attach(model)
    for it in range(30):
        plane.put(_big(_ids(rank, it, 48)))
        batch = plane.fetch(32)
        # the backward launches the next round while the last round's demotion may still run
        model(batch["frame"][:, :4].float()).sum().backward()
        for _ in range(3):
            stats = plane.store_stats()
            assert sum(t["items"] for t in stats["tiers"]) <= 256
        assert torch.equal(batch["frame"], _big(batch["id"])["frame"]), "corrupted item"
    plane.flush()
    plane.wait()
    plane.shard.settle()
    assert plane.shard.size == int(plane.sizes[rank])  # the replicated size matches the shard
    sizes = plane.sizes.tolist()
    plane.close()
    return sizes


def test_store_stats_during_rounds_never_changes_the_shard(tmp_path):
    res = run_ranks(_stats_during_rounds, 2, str(tmp_path), timeout_s=150)
    assert res[0] == res[1]  # every rank agrees on every shard's size


def test_tier_stats_never_take_over_the_background_demotion(tmp_path):
    """Only the round thread may wait for (and so hand over) the demotion it started."""
    from conduit_dist.tiers import DiskTier, MemoryTier, TieredShard

    shard = TieredShard([MemoryTier(4, 8), DiskTier(8, 8, str(tmp_path))], background=True)
    shard.append(torch.arange(32, dtype=torch.uint8).view(4, 8))
    shard.demote_ahead(4)
    assert shard.stats()["tiers"][0]["items"] in (0, 4)  # before or after, never halfway
    assert shard._ahead is not None  # still the round's to settle
    shard.settle()
    assert [t["items"] for t in shard.stats()["tiers"]] == [0, 4]
    shard.close()


# ---------------------------------------------------------------- staging: rejected and bounded


def test_rejected_put_on_a_full_ring_leaves_the_store_as_it_was():
    cd.init_distributed()
    plane = cd.DataPlane(spec(), capacity_per_rank=10, seed=0)
    plane.put(make_batch(torch.arange(10)))
    plane.fetch(1)  # the ring is full; the next put's slots hold live items
    bad = make_batch(torch.arange(10, 15))
    bad["obs"][3, 1] = float("nan")
    with pytest.raises(cd.SpecError, match="'obs'.*NaN"):
        plane.put(bad)
    ids = plane.fetch(400, oversample=True)["id"]
    assert set(ids.tolist()) == set(range(10)) and len(plane) == 10
    plane.put(make_batch(torch.arange(10, 13)))  # a good put after the rejection
    batch = plane.fetch(400, oversample=True)
    assert_intact(batch)
    assert set(batch["id"].tolist()) == set(range(3, 13))
    plane.close()


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_puts_without_rounds_stay_bounded_at_world_size_one():
    cd.init_distributed()
    example = {"obs": torch.randn(256, 64), "action": torch.zeros(256, dtype=torch.int64)}
    plane = cd.DataPlane(cd.ExperienceSpec.from_batch(example), 10_000, seed=0)
    before = _rss_mb()
    for _ in range(4000):  # ~270 MB of items for a 2.7 MB store, and no round in between
        plane.put(example)
    grown = _rss_mb() - before
    assert grown < 64, f"the process grew {grown:.0f} MB"
    plane.fetch(1)
    assert len(plane) == 10_000
    assert plane.store_stats()["evictions"] == 4000 * 256 - 10_000
    plane.close()


def _staging_limit(rank, world):
    plane = cd.DataPlane(
        spec(), capacity_per_rank=10, seed=0, schedule="sync", placement="round_robin"
    )
    if rank == 0:
        for it in range(5):  # 50 items before any round: the global store holds 20
            plane.put(make_batch(_ids(0, it, 10)))
    plane.flush()
    held = shard_items(plane).tolist()
    dropped = plane.store_stats()["dropped_at_staging"]
    with pytest.raises(cd.ConfigError, match="staging limit of 20"), plane.staged(21):
        pass
    plane.close()
    return held, dropped


def test_staging_drops_the_oldest_beyond_the_global_capacity():
    res = run_ranks(_staging_limit, 2)
    assert res[0][1] == 30 and res[1][1] == 0
    held = sorted(res[0][0] + res[1][0])
    assert held == sorted(torch.cat([_ids(0, it, 10) for it in (3, 4)]).tolist())


# ---------------------------------------------------------------- scheduling


def _actor_auto(rank, world):
    plane = cd.DataPlane(
        spec(),
        200,
        seed=0,
        learner_ranks=[0],
        schedule="auto",
        auto_trial=5,
        transport=cd.TransportConfig(timeout_s=20),
    )
    model = Learner()
    if rank == 0:
        plane.attach(model)
    for it in range(30):
        if rank == 0:
            plane.put(make_batch(_ids(rank, it, 2)))
            _step(model, plane.fetch(4))
        else:
            plane.put(make_batch(_ids(rank, it, 4)))
            plane.flush()
    chosen = plane.chosen_schedule
    plane.close()
    return chosen


def test_auto_schedule_ends_its_trial_on_actors_too():
    res = run_ranks(_actor_auto, 2)
    assert res[1] in ("sync", "overlap") and res[0] in ("sync", "overlap")


def _failed_prefetch(rank, world):
    plane = cd.DataPlane(
        spec(), 100, seed=0, schedule="overlap", transport=cd.TransportConfig(timeout_s=3)
    )
    model = Learner()
    plane.attach(model)
    plane.put(make_batch(_ids(rank, 0, 4)))
    batch = plane.fetch(4)
    if rank == 1:  # no backward: rank 1 never joins round 1 (until rank 0's 3 s timeout passed)
        time.sleep(7)
        return "left"
    _step(model, batch)  # rank 0 launches round 1
    size = len(plane)
    with pytest.raises(cd.RoundError, match="round 1"):
        plane.wait()
    assert len(plane) == size  # never a half-finished round
    with pytest.raises(cd.RoundError, match="failed in round 1"):
        plane.fetch(4)
    plane.close()
    return "raised"


def test_a_failed_prefetched_round_raises_at_wait():
    res = run_ranks(_failed_prefetch, 2, timeout_s=60, collective_timeout_s=5)
    assert res == {0: "raised", 1: "left"}


def test_close_after_a_failure_leaves_a_busy_worker_its_resources():
    """The scheduler never reports the worker stopped while it is still inside a round."""
    from conduit_dist.rounds.tickets import RoundTicket
    from conduit_dist.sched.scheduler import Scheduler

    release = threading.Event()

    class Stuck:  # a round that outlives every timeout (a collective hung in the backend)
        def run(self, ticket, weights):
            release.wait(20)
            return torch.empty(0, 8, dtype=torch.uint8), None

    sched = Scheduler("overlap", Stuck(), None, torch.device("cpu"), timeout_s=0.05)
    sched.launch(RoundTicket(7, 0, None, 0, None), "flush", 0)
    with pytest.raises(cd.RoundError, match="round 7: not finished"):
        sched.wait()
    assert sched.close(abandon=True) is False  # still inside the round: keep group and tiers
    release.set()


# ---------------------------------------------------------------- state


def _state_on_one_rank(rank, world):
    plane, model = (
        cd.DataPlane(spec(), 100, seed=2, transport=cd.TransportConfig(timeout_s=10)),
        Learner(),
    )
    plane.attach(model)
    seen = []
    for it in range(6):
        plane.put(make_batch(_ids(rank, it, 3)))
        assert_intact(batch := plane.fetch(4))
        seen.append((plane.last_fetch.round, plane.last_fetch.prefetched))
        _step(model, batch)
        if rank == 0 and it == 2:  # a round for the next fetch is in flight
            state = plane.state_dict()
            assert state["clock"]["round"] == plane.round
    plane.close()
    return seen


def test_state_dict_keeps_the_launched_round_and_is_not_collective():
    res = run_ranks(_state_on_one_rank, 2, timeout_s=90)
    assert res[0] == res[1] == [(r, r > 0) for r in range(6)]


def _round_trip(rank, world):
    plane = cd.DataPlane(spec(), 50, seed=3, schedule="sync")
    for it in range(3):
        plane.put(make_batch(_ids(rank, it, 7)))
        plane.fetch(4)
    saved = plane.state_dict()
    torch.save(saved, f"/tmp/_cd_state_{os.getpid()}.pt")
    saved = torch.load(f"/tmp/_cd_state_{os.getpid()}.pt", weights_only=True)
    os.remove(f"/tmp/_cd_state_{os.getpid()}.pt")
    kept = sorted(shard_items(plane).tolist())
    for it in range(3, 6):
        plane.put(make_batch(_ids(rank, it, 7)))
        plane.fetch(4)
    plane.load_state_dict(saved)
    restored = sorted(shard_items(plane).tolist())
    batch = plane.fetch(64, oversample=True)
    assert_intact(batch)
    assert batch["id"].max() < 1_000_000 * world and (batch["id"] % 1000 < 7).all()
    assert all(int(i) % 1_000_000 // 1000 < 3 for i in batch["id"])  # nothing after the save
    other = dict(saved, clock={**saved["clock"], "round": saved["clock"]["round"] + rank})
    with pytest.raises(cd.ConfigError, match="different rounds"):
        plane.load_state_dict(other)
    plane.close()
    with pytest.raises(RuntimeError, match="closed"):
        plane.load_state_dict(saved)
    return kept == restored


def test_load_state_dict_restores_and_checks_every_rank_agrees():
    assert all(run_ranks(_round_trip, 2).values())


# ---------------------------------------------------------------- samplers are objects


class OwnShardFirst(Sampler):
    """A sampler defined outside the package: each learner reads only its own shard."""

    name = "own_shard"

    def allocate(self, requests, sizes, round, meta):
        counts = np.zeros((sizes.shape[0],) * 2, dtype=np.int64)
        np.fill_diagonal(counts, np.where(sizes > 0, requests, 0))
        return counts

    def expected(self, requests, sizes):
        return self.allocate(requests, sizes, 0, None).astype(float)


def _custom_sampler(rank, world):
    plane = cd.DataPlane(spec(), 100, sampler=OwnShardFirst(), placement="local", schedule="sync")
    plane.put(make_batch(_ids(rank, 0, 10)))
    batch = plane.fetch(8)
    own = bool((batch["id"] // 1_000_000 == rank).all())
    moves = [m.op for m in plane.stats.moves]
    plane.close()
    return own, moves


def test_a_sampler_object_from_outside_the_package_runs_on_real_ranks():
    assert all(r == (True, []) for r in run_ranks(_custom_sampler, 2).values())


def test_samplers_and_placements_resolve_through_one_table():
    cd.init_distributed()
    with pytest.raises(cd.ConfigError, match=r"sampler: expected one of \['uniform', 'strat"):
        cd.DataPlane(spec(), 4, sampler="prioritised")
    with pytest.raises(cd.ConfigError, match="placement: expected a Placement or one of"):
        cd.DataPlane(spec(), 4, placement=cd.Uniform())
    with pytest.raises(cd.ConfigError, match=r"max_lag: expected one of \[0, 1\], got 2"):
        cd.DataPlane(spec(), 4, max_lag=2)
    sampler = cd.Uniform()
    plane = cd.DataPlane(spec(), 4, sampler=sampler)
    with pytest.raises(cd.ConfigError, match="serves another plane"):
        cd.DataPlane(spec(), 4, sampler=sampler)
    plane.close()


# ---------------------------------------------------------------- world size 1, no ceremony


_PLAIN = """
import torch, conduit_dist as cd
spec = cd.ExperienceSpec.from_batch({"x": torch.zeros(1, 3)})
plane = cd.DataPlane(spec, 10)
plane.put({"x": torch.ones(4, 3)})
assert plane.fetch(2)["x"].sum() == 6 and len(plane) == 4
plane.close()
print("ok")
"""


def test_world_size_one_needs_no_init_but_torchrun_without_a_group_is_an_error():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    ok = subprocess.run([sys.executable, "-c", _PLAIN], env=env, capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.strip() == "ok", ok.stderr[-2000:]
    env.update(RANK="0", WORLD_SIZE="2")
    bad = subprocess.run([sys.executable, "-c", _PLAIN], env=env, capture_output=True, text=True)
    assert bad.returncode != 0
    assert "call conduit_dist.init_distributed() first" in bad.stderr


# ---------------------------------------------------------------- delivery buffers


def test_a_pooled_batch_is_never_overwritten_while_any_part_of_it_is_held():
    plane = cd.DataPlane(spec(), capacity_per_rank=64, seed=5, schedule="sync")
    plane.put(make_batch(torch.arange(64)))
    kept = []  # (what the caller holds, a copy of what it held when fetched)
    for i in range(12):
        batch = plane.fetch(8)
        if i % 4 == 0:
            kept.append((batch, {k: v.clone() for k, v in batch.items()}))
        elif i % 4 == 1:
            kept.append((batch["obs"], batch["obs"].clone()))  # one field view only
        elif i % 4 == 2:
            kept.append((batch["frame"][:3], batch["frame"][:3].clone()))  # a view of a view
    for held, copy in kept:
        if isinstance(held, dict):
            assert all(torch.equal(held[k], copy[k]) for k in copy)
        else:
            assert torch.equal(held, copy)
    kept.clear()
    ptrs = {plane.fetch(8)["id"].data_ptr() for _ in range(6)}  # nothing held: reused
    assert len(ptrs) == 1
    plane.close()


def test_a_local_error_inside_a_round_fails_the_plane_naming_the_round():
    """A round that raised half-way leaves the rank out of step: every later call must raise."""

    class Buggy(cd.Uniform):  # a user's sampler with a bug in round 1
        def allocate(self, requests, sizes, round, meta):
            if round == 1:
                raise KeyError("oops")
            return super().allocate(requests, sizes, round, meta)

    plane = cd.DataPlane(spec(), capacity_per_rank=16, seed=0, sampler=Buggy(), schedule="sync")
    plane.put(make_batch(torch.arange(8)))
    plane.fetch(2)
    with pytest.raises(cd.RoundError, match="round 1 failed on rank 0: KeyError"):
        plane.fetch(2)
    with pytest.raises(cd.RoundError, match="failed in round 1"):
        plane.put(make_batch(torch.arange(8, 10)))
    plane.close()


def test_fetched_tensors_are_fresh_each_time():
    """In-place metadata changes on a fetched tensor never reach a later batch."""
    plane = cd.DataPlane(spec(), capacity_per_rank=16, seed=0, schedule="sync")
    plane.put(make_batch(torch.arange(16)))
    b = plane.fetch(4)
    b["obs"].unsqueeze_(1)
    b["obs"].requires_grad_(False)
    del b
    again = plane.fetch(4)
    assert again["obs"].shape == (4, 3)
    assert_intact(again)
    plane.close()


def test_uniform_allocation_is_the_same_with_and_without_the_native_extension(monkeypatch):
    """Every rank must compute the same allocation, whether or not its extension is built."""
    import numpy as np

    import conduit_dist.sampling.uniform as uniform_mod
    from conduit_dist.sampling import SamplerContext

    needs_native("uniform_alloc")
    u = uniform_mod.Uniform()
    u.bind(SamplerContext(3, 0, 3, np.zeros((3, 3))))
    cases = [([128, 0, 64], [40, 120, 7]), ([5, 5, 5], [0, 9, 0]), ([300, 1, 0], [1, 1, 1])]
    native = [u.allocate(np.array(r), np.array(s), 11, None) for r, s in cases]
    monkeypatch.setattr(uniform_mod, "_native", None)
    fallback = [u.allocate(np.array(r), np.array(s), 11, None) for r, s in cases]
    for a, b, (req, _) in zip(native, fallback, cases):
        assert (a == b).all()
        assert (a.sum(axis=1) == np.array(req)).all()


def _defaults(rank, world):
    names = {}
    for sampler in ("uniform", "queue"):
        for learners in (None, [0]):
            plane = cd.DataPlane(spec(), 10, sampler=sampler, learner_ranks=learners)
            names[(sampler, learners is None)] = (plane.placement.name, plane.schedule)
            plane.close()
    return names


def test_default_placement_follows_the_roles_and_the_sampler():
    """Every rank learns: local (one exchange a round); replay with actors: round_robin (the
    learners' shards store too); a sampler that reads each item once: local either way."""
    got = run_ranks(_defaults, 2)[0]
    assert got == {
        ("uniform", True): ("local", "fused"),
        ("uniform", False): ("round_robin", "general"),
        ("queue", True): ("local", "fused"),
        ("queue", False): ("local", "fused"),
    }
