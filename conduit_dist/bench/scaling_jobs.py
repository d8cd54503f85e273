"""The scaling benchmark's jobs as processes: command lines, start, wait, stop, failures.

:func:`job_argv` is one job's ``train.py`` command line (:data:`JOBS`, :data:`JOB_OVERRIDES`; what
each job is: :mod:`conduit_dist.bench.scaling`); :func:`spawn` starts it in its own process group,
:func:`wait_or_stop` waits for it within the timeout (stopping every rank past it), and
:func:`what_went_wrong` / :func:`job_error` turn a failure into a :class:`JobError` with the
output's last lines. :func:`run_floor` runs the ``floor`` job's two processes at once.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

JOBS = ("single", "colocated", "disaggregated", "floor")
TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
JOB_OVERRIDES = {
    "single": ("plane=simple", "env.num_envs=16"),
    "colocated": ("env.num_envs=8",),
    "disaggregated": ("mode=disaggregated", "learner_ranks=[0]", "env.num_envs=16"),
    "floor": ("plane=simple", "env.num_envs=8", "target_return=null"),
}
"""Each job's own overrides, after ``experiment=...`` (16 envs in all in every job)."""
TAIL_LINES = 40


class JobError(RuntimeError):
    """A training job failed, timed out or wrote no summary."""


def job_argv(
    job: str, seed: int, a: argparse.Namespace, run_dir: Path, train_py: Path, part: int = 0
) -> list[str]:
    """The command line of one job (see :mod:`conduit_dist.bench.scaling` for what each job adds).

    Args:
        job: one of :data:`JOBS`.
        seed: the run's seed.
        a: the options from :func:`parse_args`.
        run_dir: the directory for the job's summary file and Hydra run directory.
        train_py: the training script.
        part: ``floor`` only: which of its two processes (0 or 1; seeds ``seed`` and
            ``seed + 1000``).

    Returns:
        The argument list, starting with ``sys.executable``.

    Raises:
        ValueError: for a job not in :data:`JOBS`.
    """
    if job not in JOBS:
        raise ValueError(f"job: expected one of {JOBS}, got {job!r}")
    one = job in ("single", "floor")
    launch = [sys.executable] if one else [sys.executable, *TORCHRUN]
    name = f"{job}_{seed}" if job != "floor" else f"floor_{seed}_{part}"
    run_seed = seed + 1000 * part
    overrides = [f"experiment={a.experiment}", *JOB_OVERRIDES[job], f"seed={run_seed}"]
    if job == "floor":
        overrides += [f"algo.batch_size={a.floor_batch}", f"total_env_steps={a.floor_env_steps}"]
    elif a.total_env_steps is not None:
        overrides.append(f"total_env_steps={a.total_env_steps}")
    if a.no_target and job != "floor":
        overrides.append("target_return=null")
    overrides += [
        "logger.mode=disabled",
        "logger.kind=console",
        f"logger.summary_path={run_dir / f'{name}.json'}",
        f"hydra.run.dir={run_dir / name}",
        *a.extra,
        *getattr(a, f"{job}_extra"),
    ]
    return [*launch, str(train_py), *overrides]


def _tail(path: Path, lines: int = TAIL_LINES) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def finite(value: object) -> object:
    """``value`` with non-finite floats (no episode's ``return_100``) as ``None``: strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def _stop(proc: subprocess.Popen) -> None:
    """Stop ``proc``'s process group (torchrun's ranks too): SIGTERM, then SIGKILL after 10 s."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def wait_or_stop(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for ``proc``: ``False`` if it ran past ``timeout_s`` (then it is stopped).

    It runs in its own session, so a Ctrl-C here does not reach it: that stops it too.
    """
    try:
        proc.wait(timeout=timeout_s)
        return True
    except subprocess.TimeoutExpired:
        _stop(proc)
        return False
    except BaseException:
        _stop(proc)
        raise


def spawn(argv: list[str], log: Path, a: argparse.Namespace, cwd: Path) -> subprocess.Popen:
    """Start one training process, its output to ``log``, in its own process group (a timeout
    stops every rank), with ``OMP_NUM_THREADS`` = ``a.threads``."""
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        return subprocess.Popen(
            argv,
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )


def what_went_wrong(
    proc: subprocess.Popen, finished: bool, summary_path: Path, timeout_s: float
) -> str | None:
    """What went wrong with a finished (or timed-out) process, or ``None``."""
    if not finished:
        return f"timed out after {timeout_s:g} s"
    if proc.returncode != 0:
        return f"exited with status {proc.returncode}"
    if not summary_path.is_file():
        return f"exited 0 but wrote no summary file {summary_path}"
    return None


def job_error(who: str, problem: str, wall: float, argv: list[str], log: Path) -> JobError:
    """The :class:`JobError` of ``who`` (job, seed): what went wrong, its wall time, its command
    line and the last :data:`TAIL_LINES` lines of its output ``log``."""
    return JobError(
        f"scaling: {who} {problem} ({wall:.1f} s)\n"
        f"command: {shlex.join(argv)}\n"
        f"last {TAIL_LINES} lines of its output:\n{_tail(log)}"
    )


def run_floor(seed: int, a: argparse.Namespace, run_dir: Path, train_py: Path) -> dict:
    """``floor``: two single processes at once, each with a colocated rank's share of the work
    (8 envs, the per-learner batch) and no communication at all. Ranks in lockstep run at the
    slower one's pace, so the per-part maximum of their breakdowns estimates what a colocated
    iteration would cost if its data path (rounds, gradient averaging) were free."""
    argvs = [job_argv("floor", seed, a, run_dir, train_py, part) for part in (0, 1)]
    logs = [run_dir / f"floor_{seed}_{part}.log" for part in (0, 1)]
    start = time.perf_counter()
    procs = [spawn(argv, log, a, train_py.parent) for argv, log in zip(argvs, logs)]
    done = [wait_or_stop(p, a.timeout_s) for p in procs]
    wall = time.perf_counter() - start
    summaries = []
    for part, (proc, ok, argv) in enumerate(zip(procs, done, argvs)):
        path = run_dir / f"floor_{seed}_{part}.json"
        problem = what_went_wrong(proc, ok, path, a.timeout_s)
        if problem is not None:
            raise job_error(
                f"job floor seed {seed} process {part}", problem, wall, argv, logs[part]
            )
        summaries.append(finite(json.loads(path.read_text())))
    parts = summaries[0]["breakdown_ms"]
    slower = {k: max(s["breakdown_ms"][k] for s in summaries) for k in parts}
    it = slower.get("iteration") or 0.0
    return {
        "job": "floor",
        "seed": seed,
        "command": " & ".join(shlex.join(v) for v in argvs),
        "process_wall_s": wall,
        "env_steps": sum(s["env_steps"] for s in summaries),
        "env_steps_per_s": 16 * 1e3 / it if it else None,  # steady state, 2 x 8 envs
        "reached_target": False,
        "time_to_target_s": None,
        "breakdown_ms": slower,
        "schedule": "none",
    }
