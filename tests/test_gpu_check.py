"""scripts/gpu_check.sh cannot pass without a GPU: on this CPU machine it refuses at once, saying
what is wrong and what to install; its Python steps compile, import and, rehearsed on the CPU
(``GPU_CHECK_DRY_RUN=cpu``: device and pinned tiers as host tiers, CUDA-only checks skipped),
run their logic end to end."""

from __future__ import annotations

import json
import py_compile
import subprocess
import sys
import time

import pytest
import torch
from dist_utils import ROOT, child_env

SCRIPT = ROOT / "scripts" / "gpu_check.sh"
STEPS = ROOT / "scripts" / "gpu_check"
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


def _bash(*args: str, timeout: int = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", *args], cwd=ROOT, env=child_env(**env), capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def test_script_parses():
    res = _bash("-n", str(SCRIPT))
    assert res.returncode == 0, res.stderr


@NO_GPU
def test_refuses_a_cpu_build_or_a_machine_without_a_gpu_at_once():
    t0 = time.monotonic()
    res = _bash(str(SCRIPT), CONDUIT_GPU_CHECK_SKIP_INSTALL="1")
    wall = time.monotonic() - t0
    assert res.returncode != 0, res.stdout + res.stderr
    if torch.version.cuda is None:
        assert res.returncode == 2
        assert (
            f"torch {torch.__version__} is a CPU build (torch.version.cuda is None)" in res.stderr
        )
        assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" in (
            res.stderr
        )
    else:  # a CUDA build on a machine without a visible GPU
        assert res.returncode == 3
        assert "sees no GPU: torch.cuda.device_count() == 0" in res.stderr
    assert "ok " not in res.stdout  # no step claimed to pass
    assert wall < 60, f"{wall:.1f} s: the refusal comes before any step"


def test_refuses_to_run_as_a_dry_run():
    res = _bash(str(SCRIPT), CONDUIT_GPU_CHECK_SKIP_INSTALL="1", GPU_CHECK_DRY_RUN="cpu")
    assert res.returncode == 2 and "GPU_CHECK_DRY_RUN is set" in res.stderr


def test_python_steps_compile_and_import(tmp_path):
    files = sorted(STEPS.glob("*.py"))
    assert {f.stem for f in files} >= {"common", "world1", "two_ranks", "nccl_world1", "train_run"}
    for f in files:
        py_compile.compile(str(f), cfile=str(tmp_path / f"{f.stem}.pyc"), doraise=True)
    names = ", ".join(f.stem for f in files)
    code = f"import sys; sys.path.insert(0, {str(STEPS)!r}); import {names}"
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=child_env(), capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]


def _rehearse(tmp_path, nproc: int, step: str, *args: str) -> list[str]:
    """Run a step on the CPU (``nproc`` ranks under torchrun; 0: plain python); its lines."""
    launch = [sys.executable]
    if nproc:
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    res = subprocess.run(
        [*launch, str(STEPS / f"{step}.py"), *args], cwd=tmp_path,
        env=child_env(GPU_CHECK_DRY_RUN="cpu", GPU_CHECK_OUT=str(tmp_path)),
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = [line for line in res.stdout.splitlines() if line.startswith("ok ")]
    assert lines and all(line.endswith("[CPU DRY RUN, not a GPU check]") for line in lines)
    return lines


@pytest.mark.parametrize(
    ("nproc", "step", "expect"),
    [
        (0, "world1", ["a.tiers", "a.gpu_puts", "a.host_reads", "a.overlap"]),
        (1, "nccl_world1", ["c.groups", "c.plane"]),
        (
            2,
            "two_ranks",
            ["b.overlap", "b.tiers", "b.prioritized", "b.windows", "b.queues", "b.checkpoint"],
        ),
    ],
)
def test_steps_rehearsed_on_the_cpu(tmp_path, nproc, step, expect):
    lines = _rehearse(tmp_path, nproc, step)
    assert [line.split(":")[0].removeprefix("ok ") for line in lines] == expect


def test_train_step_and_summary_rehearsed_on_the_cpu(tmp_path):
    start = time.time()
    lines = _rehearse(tmp_path, 0, "train_run", "dqn", "0", "total_env_steps=800",
                      "algo.learning_starts=200")  # fmt: skip
    assert lines[0].startswith("ok d.train.dqn: train.py device=cpu total_env_steps=800")
    res = subprocess.run(
        [sys.executable, str(STEPS / "summary.py"), str(start)], cwd=tmp_path,
        env=child_env(GPU_CHECK_DRY_RUN="cpu", GPU_CHECK_OUT=str(tmp_path)),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["gpu_check"] == "cpu-dry-run (not a GPU check)"
    assert summary["steps"] == ["d.train.dqn"] and summary["numbers"]["d.train.dqn"]["env_steps"]


def test_summary_names_the_failed_steps_of_a_keep_going_run(tmp_path):
    # GPU_CHECK_KEEP_GOING=1: the script hands the failed steps over; none passed here
    res = subprocess.run(
        [sys.executable, str(STEPS / "summary.py"), str(time.time())], cwd=tmp_path,
        env=child_env(GPU_CHECK_OUT=str(tmp_path), GPU_CHECK_FAILED="a.world1 d.train.dqn-2"),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["gpu_check"] == "failed" and summary["failed"] == ["a.world1", "d.train.dqn-2"]
    assert summary["steps"] == []
