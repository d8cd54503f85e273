"""The scaling benchmark's results: medians per job over seeds, the ratios against ``single``,
the per-job table and the progress line of each finished job."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from conduit_dist.bench.scaling_jobs import JOBS
from conduit_dist.train.breakdown import PARTS

COLUMNS = tuple(p for p in PARTS if p not in ("publish", "main_cpu"))
"""The ``breakdown_ms`` parts the table shows (the summary keeps every part)."""


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
    """Medians per job over seeds and the ratios against ``single`` (see
    :mod:`conduit_dist.bench.scaling`).

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


def progress(r: dict) -> str:
    """The line printed after each job: env steps, steps/s, the target, ``return_100``, the
    steady-state iteration, the process's wall time and the schedule."""
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
