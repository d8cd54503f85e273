"""scripts/gpu_check.sh cannot pass without a GPU: on this CPU machine it refuses at once, saying
what is wrong and what to install; its step limits sum to under 10 minutes; its install step
decides right from what it finds; its Python steps compile, import and, rehearsed on the CPU
(``GPU_CHECK_DRY_RUN=cpu``: device and pinned tiers as host tiers, the GPU plane a CPU plane
rehearsing the device-rows path, CUDA-only checks skipped, every line labelled), run their logic
end to end."""

from __future__ import annotations

import importlib.util
import json
import py_compile
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from dist_utils import ROOT, child_env

SCRIPT = ROOT / "scripts" / "gpu_check.sh"
STEPS = ROOT / "scripts" / "gpu_check"
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
DRY = "[CPU DRY RUN, not a GPU check]"


def _bash(*args: str, timeout: int = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", *args], cwd=ROOT, env=child_env(**env), capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def _module(name: str):
    """A step module that imports neither torch nor ``common`` (loaded under its own name)."""
    spec = importlib.util.spec_from_file_location(f"gpu_check_{name}", STEPS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _dry_python(code: str, tmp_path) -> str:
    """Run ``code`` in a dry-run child with the steps importable; its stdout."""
    res = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(STEPS)!r})\n" + code],
        cwd=tmp_path, env=child_env(GPU_CHECK_DRY_RUN="cpu", GPU_CHECK_OUT=str(tmp_path)),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def test_script_parses():
    res = _bash("-n", str(SCRIPT))
    assert res.returncode == 0, res.stderr


def test_the_one_gpu_steps_fit_ten_minutes():
    """Every step has a limit; those a one-GPU machine runs sum to under 10 minutes (the
    two-GPU step runs only where there are two)."""
    text = SCRIPT.read_text()
    limits = {
        name: int(limit)
        for name, limit in re.findall(
            r"^\s*(?:\w+=\S+ )*(?:step|train) (\S+) (\d+)\s", text, re.MULTILINE
        )
    }
    assert {"install", "a.world1", "r.rows", "s.1.sanitizer", "s.2.sanitizer", "b.two_ranks",
            "c.nccl_world1", "o.overlap", "dqn-1", "dqn-2", "ppo-1", "grpo-1", "grpo-2",
            "k.kill_resume", "t.tokens1", "t.tokens2", "g.two_gpus"} <= limits.keys()  # fmt: skip
    one_gpu = sum(v for k, v in limits.items() if k not in ("g.two_gpus", "dqn-2-nccl"))
    assert one_gpu < 600, limits
    assert f"the sum, {one_gpu}," in text  # the header says it


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
        assert "sees no GPU: torch.cuda.is_available() is False" in res.stderr
    assert "ok " not in res.stdout  # no step claimed to pass
    assert wall < 60, f"{wall:.1f} s: the refusal comes before any step"


def test_refuses_to_run_as_a_dry_run():
    res = _bash(str(SCRIPT), CONDUIT_GPU_CHECK_SKIP_INSTALL="1", GPU_CHECK_DRY_RUN="cpu")
    assert res.returncode == 2 and "GPU_CHECK_DRY_RUN is set" in res.stderr


def test_install_keeps_a_cuda_torch_in_range_that_sees_a_gpu_and_installs_otherwise():
    plan = _module("install_plan")
    spec = plan.torch_range((ROOT / "pyproject.toml").read_text())
    assert spec == ">=2.4,<=2.14.1"
    assert plan.torch_plan("2.13.0+cu128", "12.8", True, spec) == (
        "skip", "skip install torch: 2.13.0+cu128 already installed (CUDA available)"
    )  # fmt: skip
    # a build without a local label (e.g. a container's): the CUDA version makes the label
    assert plan.torch_plan("2.6.0a0", "12.8", True, spec)[1].startswith(
        "skip install torch: 2.6.0a0+cu128 already installed"
    )
    for found, why in [
        ((None, None, False), "torch is not installed"),
        (("2.13.0+cpu", None, False), "torch 2.13.0+cpu is a CPU build"),
        (("2.3.1+cu121", "12.1", True), "torch 2.3.1+cu121 is outside pyproject's >=2.4,<=2.14.1"),
        (("2.15.0+cu130", "13.0", True), "outside pyproject's"),
    ]:
        action, line = plan.torch_plan(*found, spec)
        assert action == "install" and line.startswith("install torch==2.13.0: "), line
        assert why in line
    # a CUDA build that sees no GPU: another wheel would not either; the check refuses next
    action, line = plan.torch_plan("2.13.0+cu128", "12.8", False, spec)
    assert action == "skip" and "sees no GPU (torch.cuda.is_available() is False)" in line
    assert plan.in_range("2.14.1", spec) and not plan.in_range("2.14.2", spec)
    assert plan.in_range("2.4", spec) and not plan.in_range("2.3.9", spec)


def test_install_of_the_train_extra_only_when_an_import_fails():
    plan = _module("install_plan")
    action, line = plan.train_plan([])
    assert action == "skip" and line.startswith('skip install -e ".[train]": hydra, omegaconf')
    action, line = plan.train_plan(["wandb", "conduit_dist._native._pack"])
    assert action == "install" and "cannot import wandb, conduit_dist._native._pack" in line
    assert plan.missing_imports() == []  # this machine has the extra and the built extension


def test_python_steps_compile_and_import(tmp_path):
    files = sorted(STEPS.glob("*.py"))
    assert {f.stem for f in files} >= {
        "common", "install_plan", "world1", "rows", "sanitizer", "sanitize", "two_ranks",
        "nccl_world1", "overlap", "train_run", "train_inproc", "resume", "two_gpus", "summary",
    }  # fmt: skip
    for f in files:
        py_compile.compile(str(f), cfile=str(tmp_path / f"{f.stem}.pyc"), doraise=True)
    names = ", ".join(f.stem for f in files)
    code = f"import sys; sys.path.insert(0, {str(STEPS)!r}); import {names}"
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=child_env(), capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]


def test_sync_watch_counts_torchs_warnings_from_any_thread_and_the_librarys_syncs(tmp_path):
    out = _dry_python(textwrap.dedent("""
        import threading, warnings
        from common import SyncWatch, CheckFailed, SYNC_WARNING
        from conduit_dist.syncs import SYNCS
        w = SyncWatch()
        with w.count():
            warnings.warn(SYNC_WARNING)
            t = threading.Thread(target=lambda: warnings.warn(SYNC_WARNING))
            t.start(); t.join()
            SYNCS.add("priority updates")
            warnings.warn("something else")  # not a sync: passed on
        with w.count():
            pass
        assert w.torch == [2, 0] and w.library == [1, 0], (w.torch, w.library)
        assert w.reasons == {"priority updates": 1}
        assert w.within(1, 0, 0, "steady") == {"blocks": 1, "torch_max": 0, "torch_mean": 0.0,
                                               "library_max": 0, "library_mean": 0.0}
        try:
            w.within(0, 1, 1, "every block")
        except CheckFailed as exc:
            assert "torch 1" in str(exc) and "priority updates" in str(exc), exc
            print("refused:", exc)
    """), tmp_path)  # fmt: skip
    assert "refused: every block: host syncs per block" in out


def test_the_sanitizer_verdict_reads_races_and_exit_codes(tmp_path):
    out = _dry_python(textwrap.dedent("""
        from sanitize import RACE, verdict
        assert verdict(0, "ok s.2.done: ...") is None
        assert verdict(1, "Traceback ...") == "exit code 1"
        two = f"{RACE} on tensor with data pointer 1\\n...\\n{RACE} on tensor 2\\n"
        assert verdict(0, two) == "2 possible data race(s) reported (exit code 0)"
        print("verdicts ok")
    """), tmp_path)  # fmt: skip
    assert "verdicts ok" in out


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
    assert lines and all(line.endswith(DRY) for line in lines)
    return lines


def _names(lines: list[str]) -> list[str]:
    return [line.split(":")[0].removeprefix("ok ") for line in lines]


@pytest.mark.parametrize(
    ("nproc", "step", "args", "expect"),
    [
        (0, "world1", (), ["a.tiers", "a.gpu_puts", "a.host_reads", "a.overlap", "a.memory"]),
        (0, "rows", (), ["r.exact", "r.syncs"]),
        (1, "nccl_world1", (), ["c.groups", "c.plane", "c.wait"]),
        (
            2,
            "two_ranks",
            (),
            ["b.overlap", "b.tiers", "b.prioritized", "b.windows", "b.queues", "b.checkpoint"],
        ),
        (2, "overlap", (), ["o.overlap", "o.memory"]),
        (1, "tokens", (), ["t.tokens1"]),
        (2, "tokens", (), ["t.tokens2"]),
        (2, "two_gpus", (), ["g.exact", "g.overlap"]),
        (
            0,
            "sanitize",
            ("2",),
            [
                f"s.2.{n}"
                for n in ("overlap", "landing", "tiers", "checkpoint", "done", "sanitizer")
            ],
        ),
    ],
)
def test_steps_rehearsed_on_the_cpu(tmp_path, nproc, step, args, expect):
    lines = _rehearse(tmp_path, nproc, step, *args)
    assert _names(lines) == expect


def test_rows_step_compares_the_device_rows_path_with_the_native_one(tmp_path):
    """The dry run's GPU plane is a CPU plane on the device-rows path: a real comparison."""
    out = _dry_python(textwrap.dedent("""
        import rows
        for kind in ("n_step", "fifo"):
            host = rows._plane(kind, "cpu", rehearse=False)
            dev = rows._plane(kind, "cpu", rehearse=True)
            print(kind, host.device_plan.compose, dev.device_plan.compose)
            host.close(); dev.close()
    """), tmp_path)  # fmt: skip
    assert "n_step native torch" in out and "fifo native torch" in out


def test_train_steps_and_summary_rehearsed_on_the_cpu(tmp_path):
    start = time.time()
    lines = _rehearse(tmp_path, 0, "train_run", "dqn", "0", "total_env_steps=800",
                      "algo.learning_starts=200")  # fmt: skip
    assert lines[0].startswith("ok d.train.dqn: train.py device=cpu total_env_steps=800")
    assert "rows and first tier (host) on cpu, bulk rows by none; host syncs" in lines[0]
    lines = _rehearse(tmp_path, 0, "train_run", "grpo", "0", "experiment=grpo",
                      "total_env_steps=256")  # fmt: skip
    assert lines[0].startswith("ok d.train.grpo: train.py device=cpu experiment=grpo")
    assert "256 responses in 2 steps" in lines[0]
    (tmp_path / "results.jsonl").open("a").write(
        json.dumps({"step": "g.two_gpus", "skipped": "1 GPU"}) + "\n"
    )
    res = subprocess.run(
        [sys.executable, str(STEPS / "summary.py"), str(start)], cwd=tmp_path,
        env=child_env(GPU_CHECK_DRY_RUN="cpu", GPU_CHECK_OUT=str(tmp_path)),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["gpu_check"] == "cpu-dry-run (not a GPU check)"
    assert summary["steps"] == ["d.train.dqn", "d.train.grpo"]
    assert summary["numbers"]["d.train.dqn"]["env_steps"] == 800
    assert summary["numbers"]["d.train.dqn"]["torch_syncs_max"] == 0
    assert summary["skipped"] == {"g.two_gpus": "1 GPU"}
    assert re.fullmatch(r"[0-9a-f]{40}", summary["commit"])
    assert summary["torch"] == torch.__version__
    assert summary["device"] == "cpu" and summary["budget_s"] == 600
    assert "driver" in summary  # None here: no nvidia-smi


def test_kill_and_resume_rehearsed_on_the_cpu(tmp_path):
    # a shorter job than the GPU's (the CPU's cores run it): killed after its first checkpoint
    lines = _rehearse(tmp_path, 0, "resume", "--steps", "3000", "--every-iters", "10",
                      "--kill-after-s", "0.2")  # fmt: skip
    assert _names(lines) == ["k.kill_resume"]
    assert "resumed from a checkpoint" in lines[0]
    finished = re.search(r"finished (\d+) env steps", lines[0])
    assert finished and int(finished.group(1)) >= 3000, lines[0]


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
