"""The examples in examples/ run end to end as their first lines launch them: ``python`` (world
size 1) and ``torchrun`` (``sys.executable -m torch.distributed.run``), for a few hundred env
steps or a few rollouts, each printing its summary as the last JSON line."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from dist_utils import ROOT, child_env


def _run(tmp_path: Path, example: str, nproc: int, *args: str) -> dict[str, object]:
    """Run ``examples/<example>`` on ``nproc`` ranks (1: plain python); its final JSON line."""
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = [*launcher, str(ROOT / "examples" / example), *args]
    res = subprocess.run(
        cmd, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=240
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("nproc", [1, 2])
def test_colocated_dqn_runs_on_one_and_two_ranks(tmp_path, nproc):
    envs = 32 // nproc  # 32 env steps per iteration: 40 iterations, the last 10 learning
    out = _run(tmp_path, "colocated_dqn.py", nproc, "--env-steps", "1280", "--num-envs", str(envs))
    assert out["env_steps"] == 1280
    assert out["return_100"] is not None  # episodes ended on every rank (learning: README)


@pytest.mark.parametrize("nproc", [2, 3])
def test_disaggregated_dqn_actors_pull_published_versions(tmp_path, nproc):
    envs = 32 // (nproc - 1)  # 32 env steps per iteration over the actors: 40 iterations
    args = ["--env-steps", "1280", "--num-envs", str(envs)]
    out = _run(tmp_path, "disaggregated_dqn.py", nproc, *args)
    per_iter = envs * (nproc - 1)
    iters = math.ceil(1280 / per_iter)
    assert out["env_steps"] == iters * per_iter
    assert out["return_100"] is not None
    # one version at the start, then one every 4th iteration once learning (from 1000 steps)
    first = math.ceil(1000 / per_iter)
    assert out["policy_version"] == 1 + sum(it % 4 == 0 for it in range(first, iters + 1))
    assert out["stale_evicted"] == 0  # 500 versions are never reached in so short a run


@pytest.mark.parametrize(
    ("nproc", "mode"), [(1, []), (2, []), (3, ["--disaggregated"])], ids=["1", "2", "3-disagg"]
)
def test_ppo_queue_trains_on_fresh_rollouts_only(tmp_path, nproc, mode):
    args = ["--env-steps", "256", "--num-steps", "32", *mode]
    out = _run(tmp_path, "ppo_queue.py", nproc, *args)
    actors = nproc - 1 if mode else nproc
    rollout = 32 * 2 * actors  # 2 envs per acting rank
    assert out["env_steps"] == math.ceil(256 / rollout) * rollout
    assert out["policy_age_max"] == 0  # every learner trained on its current policy's rollout
    assert out["return_100"] is not None


@pytest.mark.parametrize("nproc", [1, 2])
def test_grpo_colocated_streams_groups_on_one_and_two_ranks(tmp_path, nproc):
    out = _run(tmp_path, "grpo_colocated.py", nproc, "--steps", "6")
    assert out["steps"] == 6
    assert 0 <= out["reward_first_100"] <= 1 and 0 <= out["reward_100"] <= 1
