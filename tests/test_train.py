"""train.py end to end: torchrun, Hydra composition, W&B offline run, disaggregated mode."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_utils import ROOT, child_env, learners_and_attached
from wandb_reader import history, summary


def _torchrun(tmp_path: Path, *overrides: str, nproc: int = 2, timeout: int = 240, **env):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(ROOT / "train.py"),
        *overrides,
        f"hydra.run.dir={tmp_path}",
    ]
    return subprocess.run(
        cmd, cwd=tmp_path, env=child_env(**env), capture_output=True, text=True, timeout=timeout
    )


def test_smoke_two_ranks_writes_wandb_offline_with_latency_metrics(tmp_path):
    res = _torchrun(tmp_path, "experiment=smoke", "logger=wandb", "logger.mode=offline")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "done:" in res.stdout + res.stderr
    # one .hydra directory, written by rank 0 only
    assert (tmp_path / ".hydra" / "config.yaml").is_file()
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    assert len(runs) == 1, runs
    rows = history(glob.glob(os.path.join(runs[0], "*.wandb"))[0])
    keys = {k for row in rows for k in row}
    waits = [row["path/wait_ms_mean"] for row in rows if "path/wait_ms_mean" in row]
    assert waits and all(w >= 0 for w in waits)
    for k in (
        "path/ingest_ms_mean",
        "path/sample_ms_mean",
        "path/deliver_ms_mean",
        "path/wait_ms_mean",
        "path/bytes_in",
        "store/occupancy",
        "rl/episode_return_100",
        "rate/env_steps_per_s",
        "rate/learner_steps_per_s",
        "env_steps",
        "path/bytes_host",
    ):
        assert k in keys, (k, sorted(keys))
    assert any(k.startswith("path/policy_age_hist") for k in keys)
    assert "rl/best_return_100" in summary(glob.glob(os.path.join(runs[0], "*.wandb"))[0])
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()  # beside the W&B run
    assert len(lines) == len(waits)


def test_misspelled_override_fails_with_hydra_message(tmp_path):
    res = _torchrun(
        tmp_path, "experiment=smoke", "logger=none", "plane.capacty_per_rank=5", nproc=1
    )
    assert res.returncode != 0
    assert "Could not override 'plane.capacty_per_rank'" in res.stderr
    assert "Key 'capacty_per_rank' not in 'PlaneConfig'" in res.stderr


def test_bad_value_names_field(tmp_path):
    res = _torchrun(tmp_path, "experiment=smoke", "logger=none", "mode=sideways", nproc=1)
    assert res.returncode != 0
    assert "mode: expected one of ['colocated', 'disaggregated'], got 'sideways'" in res.stderr


def test_disaggregated_runs(tmp_path):
    res = _torchrun(
        tmp_path,
        "experiment=smoke",
        "logger=console",
        "mode=disaggregated",
        "learner_ranks=[0]",
        "total_env_steps=1600",
        "algo.learning_starts=200",
        "logger.log_every=20",
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout + res.stderr
    assert "done:" in out and "ret100=" in out


def test_learners_with_a_dqn_actor_attached_from_outside_the_job(tmp_path):
    """Two learner ranks open ingresses; an actor started after them (python train.py
    algo.role=actor) attaches, acts with each newer network and puts; both end cleanly."""
    act_dir = tmp_path / "ingress"
    learned, acted = learners_and_attached(
        tmp_path,
        ["experiment=smoke", "logger=none", "mode=disaggregated", "algo.actors=attached",
         f"algo.attach_dir={act_dir}", "total_env_steps=1600", "algo.learning_starts=200",
         "logger.log_every=20"],
        ["experiment=smoke", "algo.role=actor", f"algo.attach_dir={act_dir}"],
    )  # fmt: skip
    assert learned["env_steps"] >= 1600  # every step an attached actor had acknowledged
    assert acted["env_steps"] >= learned["env_steps"] and acted["episodes"] > 0
    assert acted["versions_seen"] >= 2  # it acted with the learners' newer networks
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows and rows[-1]["learner_steps"] > 0
    assert rows[-1]["attach/items"] >= 1600 and rows[-1]["attach/live"] >= 0  # the ledger


@pytest.mark.parametrize("plane", ["conduit", "simple"])
def test_world_size_one_plain_python(tmp_path, plane):
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        "experiment=smoke",
        "logger=none",
        f"plane={plane}",
        "total_env_steps=800",
        "algo.learning_starts=200",
        f"hydra.run.dir={tmp_path}",
    ]
    res = subprocess.run(
        cmd, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-3000:]


def test_tiers_sampling_and_placement_from_the_command_line(tmp_path):
    disk = tmp_path / "disk"
    res = _torchrun(
        tmp_path,
        "experiment=smoke",
        "logger=none",
        "total_env_steps=1600",
        "algo.learning_starts=200",
        "plane.tiers=[[host,1000],[disk,3000]]",
        f"plane.disk_dir={disk}",
        "plane.sampler=stratified",
        "plane.placement=bandwidth_aware",
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert not list(disk.iterdir())  # disk tier files removed on close


def test_prioritized_nstep_from_the_command_line(tmp_path):
    """plane.sampler=prioritized algo.n_step=3: the learners' priority updates reach the shards
    (rank 0's shard applied some) and the job finishes."""
    summary = tmp_path / "summary.json"
    res = _torchrun(
        tmp_path,
        "experiment=smoke",
        "logger=none",
        "total_env_steps=1600",
        "algo.learning_starts=200",
        "plane.sampler=prioritized",
        "algo.n_step=3",
        f"logger.summary_path={summary}",
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    stats = json.loads(summary.read_text())["sampler"]
    assert stats["priority_updates_applied"] > 0, stats


@pytest.mark.parametrize(
    "mode,nproc,extra",
    [
        ("colocated", 2, ("logger=console",)),
        ("disaggregated", 3, ("learner_ranks=[0]", "logger=wandb")),
    ],
)
def test_ppo_smoke_every_item_within_the_policy_age_bound(tmp_path, mode, nproc, extra):
    """experiment=cartpole_ppo, a few iterations: rollouts through the WithoutReplacement
    sampler with max_policy_age=0; every delivered item's age was 0 (checked on every row by the
    plane, and reported by the trainer); disaggregated logs the age histogram to W&B."""
    summary = tmp_path / "summary.json"
    res = _torchrun(
        tmp_path,
        "experiment=cartpole_ppo",
        f"mode={mode}",
        *extra,
        "total_env_steps=3072",
        "logger.log_every=2",
        "logger.mode=offline",
        "plane.calibrate=false",
        f"logger.summary_path={summary}",
        nproc=nproc,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = json.loads(summary.read_text())
    assert got["env_steps"] == 3072 and got["max_policy_age_seen"] == 0, got
    assert got["iterations"] == 6 and got["return_100"] > 0, got
    if "logger=wandb" in extra:
        runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
        rows = history(glob.glob(os.path.join(runs[0], "*.wandb"))[0])
        keys = {k for row in rows for k in row}
        assert "path/policy_age_max" in keys, keys
        assert any(k.startswith("path/policy_age_hist") for k in keys), keys
