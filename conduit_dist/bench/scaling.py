"""``python -m conduit_dist.bench scaling``: one process against two ranks, end to end.

Side by side in one run, on the same experiment (``--experiment``, default ``cartpole_dqn``) and
seeds, three training jobs of ``train.py``, each a subprocess started from the repository root:

- ``single``: ``python train.py plane=simple env.num_envs=16`` (the single-process ring-buffer
  baseline: 16 envs in one process);
- ``colocated``: ``torchrun --standalone --nproc_per_node=2 train.py env.num_envs=8`` (every rank
  acts with 8 envs and learns: 16 envs in all);
- ``disaggregated``: ``torchrun --standalone --nproc_per_node=2 train.py mode=disaggregated
  learner_ranks=[0] env.num_envs=16`` (rank 1 acts with 16 envs, rank 0 learns).

The envs are 16 in every job, set explicitly so an experiment's own ``env.num_envs`` cannot tilt
the comparison. torchrun is ``sys.executable -m torch.distributed.run`` (the same interpreter).
Every process (``single``, and each rank) gets ``OMP_NUM_THREADS`` = ``--threads`` (default 1,
what torchrun gives its ranks anyway); left to torch's default, the one process would run one
intra-op thread per core, and a second thread's CPU went mostly to waiting on small MLPs with 2
cores. ``--threads 2 --jobs single`` is the neutral setting to report beside it.

Jobs run alternating (seed 0: single, colocated, disaggregated; then seed 1 ...), so the machine's
drift hits all of them alike. Every job gets ``logger.mode=disabled logger.kind=console``, its own
``logger.summary_path`` and ``hydra.run.dir`` in a temporary directory, then ``--extra`` (all
jobs) and its ``--JOB-extra`` overrides, last so they win. A job that fails or runs past
``--timeout-s`` stops the benchmark with its name, seed, command line and the last lines of its
output (exit status 1).

Per job and seed, the result is rank 0's summary file (``env_steps``, ``wall_s``,
``time_to_target_s``, ``env_steps_per_s``, ``breakdown_ms``: ms per iteration, mean over ranks,
over the windows spent wholly learning, ...) plus ``process_wall_s``, the subprocess's whole wall
time with start-up, measured here. A run too short to have such a window reports an all-zero
``breakdown_ms``: it is left out of the breakdown's medians (``-`` in the table).

The JSON line's ``summary`` has, per job, the medians over seeds (``time_to_target_s`` over the
seeds that reached the target only, ``null`` if none did); ``JOB_steps_per_s_vs_single`` and
``JOB_time_to_target_vs_single`` for ``colocated`` and ``disaggregated``: ratios of the medians
(not medians of per-seed ratios: the jobs of one seed are not paired runs, and a seed that misses
the target has no time to pair), ``null`` where ``single`` was not run or either job never reached
the target; ``JOB_iteration_throughput_vs_single``: the steady-state comparison (the single
job's iteration over the job's, both moving 16 env steps; ``floor``'s env steps/s is steady state
too, so its ``_steps_per_s_vs_single`` is flattered against a whole-run rate with start-up; use
this one); and ``seeds_reached``: per job, how many seeds reached the target.

Example::

    python -m conduit_dist.bench scaling --seeds 0 1 2 --out bench_out/scaling.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import conduit_dist
from conduit_dist.bench.common import emit, number, out_path
from conduit_dist.train.breakdown import PARTS

JOBS = ("single", "colocated", "disaggregated", "floor")
TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
JOB_OVERRIDES = {
    "single": ("plane=simple", "env.num_envs=16"),
    "colocated": ("env.num_envs=8",),
    "disaggregated": ("mode=disaggregated", "learner_ranks=[0]", "env.num_envs=16"),
    "floor": ("plane=simple", "env.num_envs=8", "target_return=null"),
}
"""Each job's own overrides, after ``experiment=...`` (16 envs in all in every job)."""
COLUMNS = tuple(p for p in PARTS if p not in ("publish", "main_cpu"))
"""The ``breakdown_ms`` parts the table shows (the summary keeps every part)."""
TAIL_LINES = 40


class JobError(RuntimeError):
    """A training job failed, timed out or wrote no summary."""


def train_script() -> Path:
    """The repository's ``train.py``: the parent directory of the ``conduit_dist`` package.

    Returns:
        Its path.

    Raises:
        FileNotFoundError: if it is not there (e.g. ``conduit_dist`` installed without the repo).
    """
    path = Path(conduit_dist.__file__).resolve().parents[1] / "train.py"
    if not path.is_file():
        raise FileNotFoundError(
            f"train.py not found at {path}: the scaling bench runs the repository's train.py "
            "and needs conduit_dist imported from a checkout (pip install -e .)"
        )
    return path


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse and check the benchmark's options (argparse errors exit with status 2).

    Args:
        argv: the options, without the benchmark's name.

    Returns:
        The options; ``jobs`` in the order of :data:`JOBS`, without repeats.
    """
    p = argparse.ArgumentParser(prog="python -m conduit_dist.bench scaling")
    p.add_argument("--seeds", nargs="+", type=number(int, 0), default=[0, 1, 2])
    p.add_argument("--experiment", default="cartpole_dqn", help="a conf/experiment/ name")
    p.add_argument("--total-env-steps", type=number(int, 1), default=None)
    p.add_argument("--no-target", action="store_true", help="pass target_return=null")
    p.add_argument("--jobs", nargs="+", choices=JOBS, default=list(JOBS))
    p.add_argument("--timeout-s", type=number(float, 0, strict=True), default=900.0)
    p.add_argument(
        "--threads", type=number(int, 1), default=1, help="OMP_NUM_THREADS of every process"
    )
    p.add_argument("--extra", nargs="+", action="extend", default=[], metavar="OVERRIDE")
    for job in JOBS:
        p.add_argument(f"--{job}-extra", nargs="+", action="extend", default=[], metavar="OVERRIDE")
    p.add_argument(
        "--floor-batch",
        type=number(int, 1),
        default=64,
        help="floor: each process's batch (the colocated job's per-learner batch: the "
        "experiment's algo.batch_size over 2 learners)",
    )
    p.add_argument(
        "--floor-env-steps", type=number(int, 1), default=60_000, help="floor: env steps each"
    )
    p.add_argument("--out", type=out_path(".json"), default=None, help="full results as JSON")
    a = p.parse_args(argv)
    if len(set(a.seeds)) != len(a.seeds):
        p.error(f"argument --seeds: expected distinct seeds, got {a.seeds}")
    a.jobs = [j for j in JOBS if j in a.jobs]
    try:
        conf = train_script().parent / "conf" / "experiment"
    except FileNotFoundError as e:
        p.error(str(e))
    if not (conf / f"{a.experiment}.yaml").is_file():
        known = sorted(f.stem for f in conf.glob("*.yaml"))
        p.error(f"argument --experiment: expected one of {known} (in {conf}), got {a.experiment!r}")
    return a


def job_argv(
    job: str, seed: int, a: argparse.Namespace, run_dir: Path, train_py: Path, part: int = 0
) -> list[str]:
    """The command line of one job (see the module docstring for what each job adds).

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


def _finite(value: object) -> object:
    """``value`` with non-finite floats (no episode's ``return_100``) as ``None``: strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
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


def _wait(proc: subprocess.Popen, timeout_s: float) -> bool:
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


def run_job(
    job: str,
    seed: int,
    a: argparse.Namespace,
    run_dir: Path,
    train_py: Path | None = None,
) -> dict:
    """Run one job to the end and read its summary.

    Args:
        job: one of :data:`JOBS`.
        seed: the run's seed.
        a: the options from :func:`parse_args` (``timeout_s`` bounds the job).
        run_dir: where the job's summary, Hydra directory and output log go.
        train_py: the training script (default: :func:`train_script`).

    Returns:
        ``job``, ``seed``, ``command``, ``process_wall_s`` and the summary file's keys.

    Raises:
        JobError: if the job exits non-zero, runs past ``a.timeout_s`` or writes no summary;
            the message names the job, the seed and the command, with the output's last lines.
    """
    train_py = train_script() if train_py is None else train_py
    if job == "floor":
        return _run_floor(seed, a, run_dir, train_py)
    argv = job_argv(job, seed, a, run_dir, train_py)
    log = run_dir / f"{job}_{seed}.log"
    summary_path = run_dir / f"{job}_{seed}.json"
    start = time.perf_counter()
    proc = _spawn(argv, log, a, train_py.parent)
    finished = _wait(proc, a.timeout_s)
    wall = time.perf_counter() - start
    problem = _problem(proc, finished, summary_path, a.timeout_s)
    if problem is not None:
        raise _job_error(f"job {job} seed {seed}", problem, wall, argv, log)
    summary = json.loads(summary_path.read_text())
    ours = {"job": job, "seed": seed, "command": shlex.join(argv), "process_wall_s": wall}
    return ours | {k: v for k, v in _finite(summary).items() if k not in ours}


def _spawn(argv: list[str], log: Path, a: argparse.Namespace, cwd: Path) -> subprocess.Popen:
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


def _problem(
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


def _job_error(who: str, problem: str, wall: float, argv: list[str], log: Path) -> JobError:
    return JobError(
        f"scaling: {who} {problem} ({wall:.1f} s)\n"
        f"command: {shlex.join(argv)}\n"
        f"last {TAIL_LINES} lines of its output:\n{_tail(log)}"
    )


def _run_floor(seed: int, a: argparse.Namespace, run_dir: Path, train_py: Path) -> dict:
    """``floor``: two single processes at once, each with a colocated rank's share of the work
    (8 envs, the per-learner batch) and no communication at all. Ranks in lockstep run at the
    slower one's pace, so the per-part maximum of their breakdowns estimates what a colocated
    iteration would cost if its data path (rounds, gradient averaging) were free."""
    argvs = [job_argv("floor", seed, a, run_dir, train_py, part) for part in (0, 1)]
    logs = [run_dir / f"floor_{seed}_{part}.log" for part in (0, 1)]
    start = time.perf_counter()
    procs = [_spawn(argv, log, a, train_py.parent) for argv, log in zip(argvs, logs)]
    done = [_wait(p, a.timeout_s) for p in procs]
    wall = time.perf_counter() - start
    summaries = []
    for part, (proc, ok, argv) in enumerate(zip(procs, done, argvs)):
        path = run_dir / f"floor_{seed}_{part}.json"
        problem = _problem(proc, ok, path, a.timeout_s)
        if problem is not None:
            raise _job_error(
                f"job floor seed {seed} process {part}", problem, wall, argv, logs[part]
            )
        summaries.append(_finite(json.loads(path.read_text())))
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


def _median(values: Sequence[object]) -> float | None:
    nums = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return statistics.median(nums) if nums else None


def _has_breakdown(r: dict) -> bool:
    """Whether the run timed a learning window (else its ``breakdown_ms`` is all zeros)."""
    it = (r.get("breakdown_ms") or {}).get("iteration")
    return isinstance(it, (int, float)) and it > 0


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def summarize(results: Sequence[dict]) -> dict:
    """Medians per job over seeds and the ratios against ``single`` (module docstring).

    Args:
        results: the per-job, per-seed dicts of :func:`run_job` (keys used: ``job``,
            ``env_steps_per_s``, ``time_to_target_s``, ``reached_target``, ``env_steps``,
            ``wall_s``, ``process_wall_s``, ``breakdown_ms``).

    Returns:
        ``{job: medians}`` for every job in ``results``, ``JOB_steps_per_s_vs_single`` and
        ``JOB_time_to_target_vs_single`` for each other job, and ``seeds_reached``.
    """
    jobs = [j for j in JOBS if any(r["job"] == j for r in results)]
    summary: dict = {}
    reached: dict[str, int] = {}
    for job in jobs:
        rows = [r for r in results if r["job"] == job]
        hit = [r for r in rows if r.get("reached_target") and r.get("time_to_target_s") is not None]
        reached[job] = len(hit)
        timed = [r["breakdown_ms"] for r in rows if _has_breakdown(r)]
        parts = sorted({k for b in timed for k in b})
        summary[job] = {
            "seeds": len(rows),
            "env_steps_per_s": _median([r.get("env_steps_per_s") for r in rows]),
            "time_to_target_s": _median([r["time_to_target_s"] for r in hit]),
            "env_steps": _median([r.get("env_steps") for r in rows]),
            "wall_s": _median([r.get("wall_s") for r in rows]),
            "process_wall_s": _median([r.get("process_wall_s") for r in rows]),
            "breakdown_ms": {k: _median([b.get(k) for b in timed]) for k in parts},
        }
    base = summary.get("single", {})
    for job in jobs:
        if job == "single":
            continue
        summary[f"{job}_steps_per_s_vs_single"] = _ratio(
            summary[job]["env_steps_per_s"], base.get("env_steps_per_s")
        )
        summary[f"{job}_time_to_target_vs_single"] = _ratio(
            summary[job]["time_to_target_s"], base.get("time_to_target_s")
        )
        # steady state: every job's iteration moves 16 env steps, so iterations compare directly
        summary[f"{job}_iteration_throughput_vs_single"] = _ratio(
            (base.get("breakdown_ms") or {}).get("iteration"),
            summary[job]["breakdown_ms"].get("iteration"),
        )
    summary["seeds_reached"] = reached
    return summary


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _progress(r: dict) -> str:
    target = r.get("time_to_target_s")
    reached = f"target in {target:.1f} s" if r.get("reached_target") else "target not reached"
    it = r["breakdown_ms"]["iteration"] if _has_breakdown(r) else None
    return (
        f"{r['job']:<13} seed {r['seed']}: {r.get('env_steps')} env steps, "
        f"{_fmt(r.get('env_steps_per_s'), '.0f')} steps/s, {reached}, return_100 "
        f"{_fmt(r.get('return_100'), '.1f')}, iteration {_fmt(it, '.2f')} ms, process "
        f"{r['process_wall_s']:.1f} s, schedule {r.get('schedule')}"
    )


def table(summary: dict) -> str:
    """The per-job table of medians over seeds (breakdown columns in ms per iteration).

    Args:
        summary: the result of :func:`summarize`.

    Returns:
        The table's lines, joined.
    """
    head = f"{'job':<13} {'steps/s':>8} {'to_target_s':>15} {'env_steps':>9} {'proc_s':>7}"
    lines = [head + "".join(f" {c:>9}" for c in COLUMNS)]
    for job in (j for j in JOBS if j in summary):
        s = summary[job]
        ttt = f"{_fmt(s['time_to_target_s'], '.1f')} ({summary['seeds_reached'][job]}/{s['seeds']})"
        row = (
            f"{job:<13} {_fmt(s['env_steps_per_s'], '.0f'):>8} {ttt:>15} "
            f"{_fmt(s['env_steps'], '.0f'):>9} {_fmt(s['process_wall_s'], '.1f'):>7}"
        )
        lines.append(row + "".join(f" {_fmt(s['breakdown_ms'].get(c), '.3f'):>9}" for c in COLUMNS))
    return "\n".join(lines)


def run_all(a: argparse.Namespace, run_dir: Path, train_py: Path | None = None) -> list[dict]:
    """Every job for every seed, alternating (per seed: the jobs in turn), printing progress.

    Args:
        a: the options from :func:`parse_args`.
        run_dir: the directory for the jobs' files.
        train_py: the training script (default: :func:`train_script`).

    Returns:
        The per-job, per-seed results of :func:`run_job`, in the order run.

    Raises:
        JobError: from the first job that fails.
    """
    results = []
    for seed in a.seeds:
        for job in a.jobs:
            results.append(run_job(job, seed, a, run_dir, train_py))
            print(_progress(results[-1]), flush=True)
    return results


def main(argv: list[str]) -> None:
    """Run the scaling benchmark; print the table, then the JSON line last.

    Exits with status 1 and the failing job's name, seed, command and output tail on stderr if a
    job fails.
    """
    a = parse_args(argv)
    print(
        f"scaling: {a.experiment}, jobs {' '.join(a.jobs)}, seeds {a.seeds}, "
        f"timeout {a.timeout_s:g} s per job",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="conduit_scaling_") as tmp:
        try:
            results = run_all(a, Path(tmp))
        except JobError as e:
            print(e, file=sys.stderr, flush=True)
            raise SystemExit(1) from None
    summary = summarize(results)
    print(table(summary), flush=True)
    extra = {
        "experiment": a.experiment,
        "seeds": a.seeds,
        "jobs": a.jobs,
        "total_env_steps": a.total_env_steps,
        "target": not a.no_target,
        "threads": a.threads,
    }
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({"bench": "scaling", **extra, "results": results, "summary": summary}, f)
    emit("scaling", results, summary, **extra)


if __name__ == "__main__":
    main(sys.argv[1:])
