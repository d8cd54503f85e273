"""The device-rows path, run on CPU planes (``CONDUIT_DEVICE_ROWS_REHEARSAL=1``): the logic a GPU
plane runs (rows gathered where the storage is, trailers and n-step values computed from host
metadata and written in one upload, windows linked from a host copy of a few columns, headers
without rows, the exact delivery exchange, payloads all-reduced by the group, every round on the
round thread with a backward hook waiting until its bulk exchanges are enqueued, GPU priorities
queued at the next fetch). Not run on a GPU here: the CUDA copies, streams and events themselves
run in ``scripts/gpu_check.sh``.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import test_matrix as tm
import torch
from dist_utils import needs_native, run_ranks
from matrix_helpers import FIELDS, N_STEP, intact, nstep_window, sampler, step

import conduit_dist as cd
from conduit_dist.errors import ConfigError
from conduit_dist.records.spec import _native
from conduit_dist.rounds.devices import REHEARSAL_ENV
from conduit_dist.sampling.device_rows import ColumnShadow, nstep_values, put_words
from conduit_dist.tiers import MemoryTier, Shard

KINDS = ("uniform", "prioritized", "n_step", "slices", "queue", "without_replacement")


def _batches(kind: str, rounds: int = 14) -> list[dict[str, torch.Tensor]]:
    """A world-size-1 plane's batches (with priority updates where the sampler takes them)."""
    plane = cd.DataPlane(cd.ExperienceSpec(FIELDS), 48, seed=5, sampler=sampler(kind))
    out, gen = [], torch.Generator().manual_seed(1)
    for t in range(rounds):
        plane.put(step(0, t))
        plane.put(step(1, t))  # a second producer's streams on the same shard
        if t < 6:
            plane.flush()
            continue
        b = plane.fetch(4, oversample=True)
        out.append({k: v.clone() for k, v in b.items()})
        if "_index" in b and kind != "slices":
            plane.update_priorities(b["_index"], torch.rand(4, generator=gen) + 0.05)
    assert plane.device_plan.compose in ("native", "torch")
    out.append({"compose": plane.device_plan.compose})
    plane.close()
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_the_device_path_gives_the_native_paths_bytes_at_world_size_one(kind, monkeypatch):
    """Same draws, same rows: every field, address, weight, n-step return and discount equal
    bit for bit (the draws do not depend on where rows are composed)."""
    needs_native()
    monkeypatch.delenv(REHEARSAL_ENV, raising=False)
    native = _batches(kind)
    monkeypatch.setenv(REHEARSAL_ENV, "1")
    device = _batches(kind)
    assert native.pop()["compose"] == "native" and device.pop()["compose"] == "torch"
    assert len(native) == len(device) > 0
    for a, b in zip(native, device):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), (kind, key, a[key][:3], b[key][:3])


def test_every_sampler_on_every_placement_is_exact_on_the_device_path(monkeypatch):
    """The support matrix (8 samplers x 3 placements, 3 ranks, chi-square against the target,
    exactly once for queues and epochs, windows and n-step values against the reference) on the
    device path: headers without candidates, the exact delivery exchange, rounds on the round
    thread."""
    monkeypatch.setenv(REHEARSAL_ENV, "1")
    res = run_ranks(tm._matrix, 3, timeout_s=400)
    for kind in tm.KINDS:
        for placement in tm.PLACEMENTS:
            tm._check(kind, 3, {rank: got[(kind, placement)] for rank, got in res.items()})


def _overlapped(rank: int, world: int) -> dict[str, object]:
    """n-step prioritized windows, rounds launched at the backward of an attached module."""
    plane = cd.DataPlane(
        cd.ExperienceSpec(FIELDS), 64, seed=7, sampler=sampler("n_step"), placement="local",
        schedule="overlap",
    )  # fmt: skip
    net = torch.nn.Linear(2, 1)
    plane.attach(net)
    plan = plane.device_plan
    bad, threads, gates, steps = [], set(), [], 16
    for t in range(steps):
        plane.put(step(rank, t))
        if t < 5:
            plane.flush()
            continue
        b = plane.fetch(6)
        threads.add(plane.stats.thread)
        gates.append(plane.stats.gate_ms)
        if not intact(b):
            bad.append("fields")
        for i, last, ret in zip(b["id"].tolist(), b["_last_id"].tolist(), b["_return"].tolist()):
            want = nstep_window(i, t + 1)
            if want is None or last != want[0] or abs(ret - want[1]) > 1e-4 * max(1, want[1]):
                bad.append(f"n-step {i}: {(last, ret)} vs {want}")
        loss = net(b["obs"]).pow(2).mean()
        plane.update_priorities(b["_index"], b["_return"].abs() + 0.1)
        loss.backward()  # launches the next fetch's round; waits until its exchange is enqueued
    stats = plane.store_stats()
    plane.close()
    applied = stats["priority_updates_applied"]
    return {
        "bad": bad, "threads": threads, "gates": gates, "applied": applied,
        "round_thread": plan.round_thread, "candidates": plan.candidates, "schedule": plan.schedule,
    }  # fmt: skip


def test_overlapped_device_rounds_run_on_the_round_thread_behind_a_gated_backward(monkeypatch):
    monkeypatch.setenv(REHEARSAL_ENV, "1")
    res = run_ranks(_overlapped, 2, timeout_s=240)
    for rank, got in res.items():
        assert not got["bad"], (rank, got["bad"][:4])
        assert got["round_thread"] and not got["candidates"] and got["schedule"] == "fused"
        assert got["threads"] == {"conduit-round_0"}, got["threads"]
        # the first fetch runs its own round; every later one was launched at a backward
        # whose hook waited for its exchange (the gate is timed)
        assert all(g >= 0 for g in got["gates"]) and any(g > 0 for g in got["gates"][1:])
        assert got["applied"] > 0  # priorities came back through the deferred queue


def test_priorities_given_on_the_device_path_are_checked_when_queued(monkeypatch):
    """No device value is read between a forward and its backward: updates are queued at the
    next fetch, where bad values raise (that update is dropped, later ones still apply)."""
    monkeypatch.setenv(REHEARSAL_ENV, "1")
    with cd.DataPlane(cd.ExperienceSpec(FIELDS), 48, sampler=sampler("prioritized")) as plane:
        for t in range(8):
            plane.put(step(0, t))
        b = plane.fetch(4)
        plane.update_priorities(b["_index"], torch.tensor([1.0, float("nan"), 1.0, 1.0]))
        plane.update_priorities(b["_index"], torch.full((4,), 2.0))
        with pytest.raises(ConfigError, match="expected finite values >= 0, got nan") as info:
            plane.fetch(4)
        assert "checked when queued, at the next fetch or flush" in str(info.value.__notes__)
        plane.fetch(4)  # the second update is queued here
        plane.fetch(4)  # and applied in this round
        assert plane.store_stats()["priority_updates_applied"] == 4


def test_nstep_values_are_the_native_loops_bytes():
    needs_native("seq_nstep")
    rng = np.random.default_rng(3)
    k, L, rb, gamma = 64, N_STEP + 2, 16, 0.97
    rewards = rng.normal(size=(k, L)).astype(np.float32)
    m = rng.integers(1, L + 1, size=k).astype(np.int64)
    term = rng.random(k) < 0.3
    rows = torch.zeros((k, L, rb), dtype=torch.uint8)
    rows.view(torch.float32)[:, :, 0] = torch.from_numpy(rewards)
    gens = torch.arange(k * L, dtype=torch.int64).view(k, L)
    last = gens[torch.arange(k), torch.from_numpy(m) - 1]
    table = torch.zeros(k * L, dtype=torch.bool)
    table[last[torch.from_numpy(term)]] = True
    out = torch.zeros((k, 2 * rb + 8), dtype=torch.uint8)
    mt = torch.from_numpy(m)
    _native.seq_nstep(
        rows.data_ptr(), k, L, rb, mt.data_ptr(), gens.data_ptr(), table.data_ptr(), k * L, 0,
        gamma, out.data_ptr(), out.stride(0), 2 * rb,
    )  # fmt: skip
    want = out[:, 2 * rb :].contiguous().view(torch.float32).numpy()
    assert np.array_equal(nstep_values(rewards, m, term, gamma).view(np.int32), want.view(np.int32))


def test_the_column_shadow_keeps_a_few_columns_and_reads_back_only_what_it_lacks():
    spec = cd.ExperienceSpec(FIELDS)
    shard = Shard(MemoryTier(8, spec.record_bytes, "cpu"))
    shadow = ColumnShadow(spec, ["done", "env", "reward"], shard.capacity)
    assert shadow.link.record_bytes < spec.record_bytes
    rows = spec.empty_records(12)
    for t in range(6):  # 12 records: 2 envs x 6 steps
        spec.pack(step(0, t), rows[2 * t : 2 * t + 2])
    shard.append(rows)  # the ring keeps the newest 8: generations 4..11
    shadow.fill(0, rows)  # the shadow keeps the newest 8 too
    got = shadow.read(torch.arange(4, 12), shard)
    cols = shadow.link.unpack(torch.from_numpy(np.ascontiguousarray(got)))
    ref = spec.unpack(rows[4:])
    for name in ("done", "env", "reward"):
        assert torch.equal(cols[name], ref[name]), name
    assert shadow.read_back == 0
    shadow.forget()  # e.g. a restore: nothing is held, so a read goes to the storage once
    shadow.read(torch.arange(6, 12), shard)
    assert shadow.read_back == 6
    shadow.read(torch.arange(6, 12), shard)
    assert shadow.read_back == 6


def test_words_go_into_the_trailer_columns_of_host_rows():
    out = torch.zeros((3, 40), dtype=torch.uint8)
    vals = torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int64)
    put_words(out, 3, vals)
    assert torch.equal(out.view(torch.int64)[:, 3:5], vals)
    assert not out.view(torch.int64)[:, :3].any()


def _probe_rows_device(rank: int, world: int) -> dict[str, object]:
    from conduit_dist.collectives.exchange import Exchange
    from conduit_dist.collectives.model import calibrate
    from conduit_dist.collectives.topology import discover

    ex = Exchange(30.0)
    model = calibrate(
        ex, discover(ex), sizes=(1024, 64 * 1024), repeats=1, device=torch.device("cpu")
    )
    ex.close()
    return {n: [float(v) for v in c] for n, c in model.coef.items()}


def test_the_rows_model_is_probed_on_the_rows_device():
    """A plane whose bulk rows live on a device calibrates them there (here the host stands for
    the GPU: the same probes, on tensors of the given device, every strategy fitted)."""
    res = run_ranks(_probe_rows_device, 2, timeout_s=120)
    assert res[0] == res[1]  # agreed: the slowest rank's times, fitted alike
    assert all(np.isfinite(c).all() for c in res[0].values())


class _Stuck:
    """A CUDA event whose work never ends (what a collective with a lost peer leaves)."""

    def query(self):
        return False

    def synchronize(self):  # never called: waiting on it would hang
        raise AssertionError("wait_event must poll, not block")


def test_a_host_sync_on_stuck_device_work_fails_by_name_instead_of_hanging():
    from conduit_dist.errors import RoundError
    from conduit_dist.syncs import SYNCS, wait_event

    before = SYNCS.snapshot().get("staging reuse", 0)
    t0 = time.monotonic()
    with pytest.raises(RoundError, match=r"staging reuse: a CUDA event has not passed after 0.2s"):
        wait_event(_Stuck(), "staging reuse", limit_s=0.2)
    assert 0.2 <= time.monotonic() - t0 < 2.0
    assert SYNCS.snapshot()["staging reuse"] == before + 1  # counted, with its reason


def _auto_and_early(rank: int, world: int) -> dict[str, object]:
    """A plane whose rows would go by NCCL (rehearsed): auto is overlap on every rank, and an
    early-started round's caller waits until its delivery is enqueued."""
    auto = cd.DataPlane(cd.ExperienceSpec(FIELDS), 32, sampler="uniform", schedule="auto")
    chosen = auto.chosen_schedule
    auto.close()
    plane = cd.DataPlane(cd.ExperienceSpec(FIELDS), 32, sampler="uniform", schedule="sync")
    gates, threads = [], set()
    for t in range(8):
        plane.put(step(rank, t))
        if t < 2:
            plane.flush()
            continue
        plane.fetch_start(4)  # the whole round on the round thread, this call gated
        plane.put(step(rank, 100 + t))  # the next round's items, while it flies
        b = plane.fetch(4)
        gates.append(plane.stats.gate_ms)
        threads.add(plane.stats.thread)
        assert intact(b)
    plane.close()
    return {"chosen": chosen, "gates": gates, "threads": threads}


def test_auto_is_overlap_everywhere_and_early_starts_are_gated_on_the_device_path(monkeypatch):
    monkeypatch.setenv(REHEARSAL_ENV, "1")
    for got in run_ranks(_auto_and_early, 2, timeout_s=180).values():
        assert got["chosen"] == "overlap"  # no per-rank trial: every rank launches alike
        assert got["threads"] == {"conduit-round_0"}
        assert all(g > 0 for g in got["gates"]), got["gates"]  # fetch_start waited
