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

This module holds the options and runs the jobs in turn; the jobs' command lines and processes are
in ``scaling_jobs.py``, the summary and the table in ``scaling_report.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import conduit_dist
from conduit_dist.bench.common import emit, number, out_path
from conduit_dist.bench.scaling_jobs import JOB_OVERRIDES as JOB_OVERRIDES
from conduit_dist.bench.scaling_jobs import (
    JOBS,
    JobError,
    finite,
    job_argv,
    job_error,
    run_floor,
    spawn,
    wait_or_stop,
    what_went_wrong,
)
from conduit_dist.bench.scaling_jobs import TORCHRUN as TORCHRUN
from conduit_dist.bench.scaling_report import COLUMNS as COLUMNS
from conduit_dist.bench.scaling_report import progress, summarize, table


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
        return run_floor(seed, a, run_dir, train_py)
    argv = job_argv(job, seed, a, run_dir, train_py)
    log = run_dir / f"{job}_{seed}.log"
    summary_path = run_dir / f"{job}_{seed}.json"
    start = time.perf_counter()
    proc = spawn(argv, log, a, train_py.parent)
    finished = wait_or_stop(proc, a.timeout_s)
    wall = time.perf_counter() - start
    problem = what_went_wrong(proc, finished, summary_path, a.timeout_s)
    if problem is not None:
        raise job_error(f"job {job} seed {seed}", problem, wall, argv, log)
    summary = json.loads(summary_path.read_text())
    ours = {"job": job, "seed": seed, "command": shlex.join(argv), "process_wall_s": wall}
    return ours | {k: v for k, v in finite(summary).items() if k not in ours}


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
            print(progress(results[-1]), flush=True)
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
