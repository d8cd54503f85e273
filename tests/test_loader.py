"""ExperienceLoader / ExperienceWriter: the same batches as a hand-written put/fetch loop, the
overlap kept, warm-up rounds, stopping at close, disaggregated rounds in step, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from dist_utils import ROOT, child_env, run_ranks
from plane_helpers import assert_intact, make_batch, spec

import conduit_dist as cd


def _ids(rank: int, it: int, n: int = 16) -> torch.Tensor:
    return rank * 1_000_000 + it * 1_000 + torch.arange(n)


def _plane(**kw) -> cd.DataPlane:
    kw.setdefault("schedule", "overlap")
    return cd.DataPlane(
        spec(), capacity_per_rank=400, seed=3, transport=cd.TransportConfig(timeout_s=30), **kw
    )


def _train_step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> None:
    model.zero_grad()
    model(batch["obs"]).sum().backward()  # launches the next round (overlap)


def _by_hand(rank, world, iters):
    """The reference: put, fetch, backward, as the README's loop."""
    plane, model, out = _plane(), torch.nn.Linear(3, 1), []
    plane.attach(model)
    for it in range(iters):
        plane.put(make_batch(_ids(rank, it)))
        batch = plane.fetch(8)
        assert_intact(batch)
        out.append(batch["id"].tolist())
        _train_step(model, batch)
    plane.close()
    return out


def _with_loader(rank, world, iters):
    plane, model, out, prefetched = _plane(), torch.nn.Linear(3, 1), [], []
    it = iter(range(iters))
    loader = cd.ExperienceLoader(
        plane, 8, collect=lambda: make_batch(_ids(rank, next(it))), rounds=iters, model=model
    )
    for batch in loader:
        assert_intact(batch)
        assert batch["obs"].device == plane.device
        out.append(batch["id"].tolist())
        prefetched.append(plane.last_fetch.prefetched)
        _train_step(model, batch)
    assert not model._backward_hooks and not model._forward_pre_hooks  # detached at the end
    plane.close()
    return out, prefetched, loader.rounds_run, loader.batches


def _both(rank, world, iters):
    return _by_hand(rank, world, iters), _with_loader(rank, world, iters)


@pytest.mark.parametrize("world", [1, 2])
def test_loader_yields_the_hand_written_loops_batches_and_keeps_the_overlap(world):
    out = run_ranks(_both, 2, 6) if world > 1 else {0: _both(0, 1, 6)}
    for r in range(world):
        ref, (batches, prefetched, rounds_run, n) = out[r]
        assert batches == ref
        assert (rounds_run, n) == (6, 6)
        if world > 1:  # every round after the first was launched at the previous backward
            assert prefetched == [False] + [True] * 5
        # at world size 1 on CPU rounds run inside the call: nothing to overlap


def _warm_up_and_close(rank, world):
    plane = _plane()
    step = iter(range(100))
    loader = cd.ExperienceLoader(
        plane, 8, collect=lambda: make_batch(_ids(rank, next(step), 10)), min_size=45
    )
    sizes = []
    for batch in loader:
        sizes.append(len(plane))
        assert len(batch["id"]) == 8
        if loader.batches == 4:
            plane.close()  # collective: every rank closes at the same batch; the loop stops
    return sizes, loader.rounds_run, loader.batches


def test_warm_up_rounds_only_ingest_and_the_loop_stops_at_close():
    out = run_ranks(_warm_up_and_close, 2)
    for r in range(2):
        sizes, rounds_run, batches = out[r]
        # 20 items per round over 2 ranks: the first yield comes once 45 are stored (3 rounds)
        assert batches == 4 and rounds_run == 3 + 4
        assert sizes[0] >= 45


def _disaggregated(rank, world, rounds):
    plane = _plane(learner_ranks=[0])
    model = torch.nn.Linear(3, 1)
    if rank == 0:
        torch.nn.init.constant_(model.weight, 0.0)
        loader = cd.ExperienceLoader(plane, 8, rounds=rounds, wait_s=20, model=model)
        seen = []
        for batch in loader:
            assert_intact(batch)
            seen.append(sorted(set((batch["id"] // 1_000_000).tolist())))
            with torch.no_grad():
                model.weight.add_(1.0)  # "train", then publish every batch
            plane.publish_weights(model)
            _train_step(model, batch)
        plane.close()
        return {"batches": loader.batches, "rounds": loader.rounds_run, "seen": seen}
    writer = cd.ExperienceWriter(plane, model=model)
    step = iter(range(rounds))
    version = writer.run(lambda: make_batch(_ids(rank, next(step))), rounds)
    weight = float(model.weight[0, 0])
    plane.close()
    return {"version": version, "rounds": writer.rounds_run, "weight": weight}


def test_disaggregated_writer_and_loader_run_the_same_rounds_and_weights_arrive():
    rounds = 8
    out = run_ranks(_disaggregated, 3, rounds)
    learner = out[0]
    assert learner["rounds"] == rounds and learner["batches"] >= 1
    assert all(set(s) <= {1, 2} for s in learner["seen"])  # only actors put
    for r in (1, 2):
        actor = out[r]
        assert actor["rounds"] == rounds
        assert actor["version"] >= 1  # weights published by the learner were pulled
        assert actor["weight"] == float(actor["version"])  # the version matches the weights


def _actor_cannot_load(rank, world):
    plane = _plane(learner_ranks=[0])
    try:
        if rank == 1:
            with pytest.raises(cd.ConfigError, match="rank 1 is an actor"):
                cd.ExperienceLoader(plane, 8)
    finally:
        plane.close()
    return True


def test_errors_name_what_was_wrong():
    run_ranks(_actor_cannot_load, 2)
    plane = _plane()
    try:
        for kw, match in [
            ({"batch_size": 0}, "batch_size: expected an int >= 1, got 0"),
            ({"batch_size": 8, "min_size": -1}, "min_size: expected an int >= 0, got -1"),
            ({"batch_size": 8, "rounds": 0}, "rounds: expected an int >= 1, got 0"),
            ({"batch_size": 8, "collect": 5}, "collect: expected a callable, got 5"),
        ]:
            with pytest.raises(cd.ConfigError, match=match):
                cd.ExperienceLoader(plane, **kw)
        with pytest.raises(cd.ConfigError, match="expected a DataPlane"):
            cd.ExperienceWriter(object())
        loader = cd.ExperienceLoader(plane, 4, collect=lambda: make_batch(_ids(0, 0, 4)), rounds=2)
        for start in ("fork", "spawn"):  # a forked worker iterates it; a spawned one pickles it
            workers = torch.utils.data.DataLoader(
                loader, batch_size=None, num_workers=1, multiprocessing_context=start
            )
            with pytest.raises(cd.ConfigError, match="DataLoader worker process"):
                next(iter(workers))
        # in the main process a DataLoader passes the batches through unchanged
        got = list(torch.utils.data.DataLoader(loader, batch_size=None, num_workers=0))
        assert len(got) == 2 and all(len(b["id"]) == 4 for b in got)
    finally:
        plane.close()
    assert plane.closed


def test_the_loader_example_runs_under_torchrun(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "examples" / "loader_dqn.py"), "--env-steps", "800",
           "--learning-starts", "400"]  # fmt: skip
    res = subprocess.run(
        cmd, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=240
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["env_steps"] == 800 and out["rounds"] == 100
    assert out["updates"] == 100 - 50  # 50 warm-up rounds of 2 ranks x 4 envs


def _learner_writer_run(rank, world):
    plane = _plane()
    try:
        with pytest.raises(cd.ConfigError, match="ExperienceWriter.run: rank 0 is a learner"):
            cd.ExperienceWriter(plane).run(lambda: None, 3)
    finally:
        plane.close()
    return True


def test_a_learner_cannot_run_a_writer_loop():
    _learner_writer_run(0, 1)
