"""A run's local record and its pictures: ``python -m conduit_dist.report RUN_DIR [--out DIR]``.

Every ``train.py`` run writes, on rank 0, ``RUN_DIR/run.json`` (the resolved config, world size,
start time) and ``RUN_DIR/metrics.jsonl`` (one JSON object per log step: ``env_steps``,
``wall_s``, ``time`` and every metric; :class:`MetricsFile`), whatever ``logger.kind`` is, so
nothing needs a W&B account to be looked at. The report reads them and draws, with matplotlib's
Agg backend (the ``[report]`` extra), into ``RUN_DIR/plots`` (or ``--out``):

- ``return.png``: the last-100 episode return vs env steps (and ``target_return``);
- ``path_time.png``: the experience path's exposed vs hidden milliseconds per learner fetch
  (one per iteration for DQN) vs env steps, stacked;
- ``link_bytes.png``: bytes the rounds sent per link class (``self`` / ``host`` / ``net``),
  cumulative, vs env steps;
- ``store_tiers.png``: the store's bytes per tier (mean over shards) vs env steps;
- ``weights.png`` (GRPO, disaggregated): the logging learner's pack and its round's transfer of
  the weights, milliseconds per version, vs trained responses.

A plot whose metrics the run did not log (e.g. PPO has no tiers) is skipped, saying so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from datetime import datetime, timezone
from typing import Any

import numpy as np

from conduit_dist.extras import require
from conduit_dist.tools.plots import PLOTS, Rows, series, xlabel

_QUANTILES = (50, 90, 99)


class MetricsFile:
    """The run's metrics as local files, readable without a W&B account.

    Writes ``run_dir/run.json`` (the resolved config, world size, start time) when created and
    appends one JSON object per log step to ``run_dir/metrics.jsonl``: ``env_steps``,
    ``wall_s`` (seconds since this logger started: the job's set-up included), ``time`` (Unix
    seconds), every metric, and each histogram's quantiles ``<name>_p50/_p90/_p99/_max``.
    Each line is flushed, so a crashed run keeps what it logged; a restarted job appends.
    Non-finite values are written as ``null``.

    Args:
        run_dir: the run's directory (created if missing).
        config: the resolved run config.
        world_size: ranks in the job.

    Example::

        f = MetricsFile("outputs/run-1", {"seed": 0}, world_size=2)
        f.log({"rl/episode_return_100": 20.5}, step=1600)
        f.close()
    """

    def __init__(self, run_dir: str, config: dict[str, Any], world_size: int) -> None:
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.t0 = time.perf_counter()
        now = time.time()
        info = {
            "config": config,
            "world_size": world_size,
            "start_time": now,
            "start_time_iso": datetime.fromtimestamp(now, timezone.utc).isoformat(),
        }
        tmp = os.path.join(run_dir, "run.json.tmp")
        with open(tmp, "w") as f:
            json.dump(_finite(info), f, indent=1)
        os.replace(tmp, os.path.join(run_dir, "run.json"))
        self._f = open(self.path, "a")  # noqa: SIM115 - open for the whole run

    def log(
        self, metrics: dict[str, float], step: int, histograms: dict[str, list[float]] | None = None
    ) -> None:
        """Append one line (and flush it)."""
        row: dict[str, Any] = {
            "env_steps": int(step),
            "wall_s": time.perf_counter() - self.t0,
            "time": time.time(),
            **metrics,
        }
        for name, values in (histograms or {}).items():
            if len(values):
                arr = np.asarray(values, dtype=np.float64)
                for q, v in zip(_QUANTILES, np.percentile(arr, _QUANTILES)):
                    row[f"{name}_p{q}"] = float(v)
                row[f"{name}_max"] = float(arr.max())
        self._f.write(json.dumps(_finite(row), allow_nan=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        """Close the file."""
        if not self._f.closed:
            self._f.close()


def _finite(obj: Any) -> Any:
    """``obj`` with NaN and infinities replaced by ``None`` (strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def read_run(run_dir: str) -> tuple[Rows, dict[str, Any]]:
    """The rows of ``run_dir/metrics.jsonl`` and ``run_dir/run.json`` (``{}`` if absent).

    A job restarted from a checkpoint appends rows that go back in env steps; the rows the
    restart lost (at or after the env steps it resumed from) are dropped, so ``env_steps``
    increases.

    Args:
        run_dir: a run's directory (e.g. ``outputs/run-<id>``).

    Returns:
        ``(rows, info)``.

    Raises:
        FileNotFoundError: naming the missing ``metrics.jsonl``.
        ValueError: naming the file and line of a row that is not JSON.

    Example::

        rows, info = read_run("outputs/run-1")
        rows[-1]["rl/episode_return_100"], info["config"]["target_return"]
    """
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"no metrics file at {os.path.abspath(path)} (every train.py run writes "
            "RUN_DIR/metrics.jsonl on rank 0; RUN_DIR is e.g. outputs/run-<id>)"
        )
    rows: Rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                if line.endswith("\n"):
                    raise ValueError(f"{path}:{i}: not a JSON object ({e})") from None
                break  # a last line cut short by a crash
            while rows and rows[-1]["env_steps"] >= row["env_steps"]:
                rows.pop()  # a restart resumed before these
            rows.append(row)
    info_path = os.path.join(run_dir, "run.json")
    info = {}
    if os.path.isfile(info_path):
        with open(info_path) as f:
            info = json.load(f)
    return rows, info


def report(run_dir: str, out: str | None = None) -> tuple[list[str], list[str]]:
    """Draw the run's PNGs.

    Args:
        run_dir: the run's directory (holding ``metrics.jsonl``).
        out: where the PNGs go (default ``run_dir/plots``; created).

    Returns:
        ``(paths written, one line per plot skipped and why)``.

    Raises:
        FileNotFoundError: without ``run_dir/metrics.jsonl`` (naming it).
        ValueError: if it holds no rows, or a row that is not JSON.
        ModuleNotFoundError: without matplotlib (the ``[report]`` extra), saying so.

    Example::

        written, skipped = report("outputs/run-1")
    """
    rows, info = read_run(run_dir)
    return _draw(rows, info, run_dir, out)


def _draw(rows: Rows, info: dict[str, Any], run_dir: str, out: str | None):
    """:func:`report` on rows already read."""
    if not rows:
        raise ValueError(f"{os.path.join(run_dir, 'metrics.jsonl')}: no rows logged yet")
    with require("report", "python -m conduit_dist.report"):
        import matplotlib
    matplotlib.use("Agg")
    out = os.path.join(run_dir, "plots") if out is None else out
    os.makedirs(out, exist_ok=True)
    written, skipped = [], []
    for name, plot, needs in PLOTS:
        path = plot(rows, info, out)
        if path is None:
            skipped.append(f"skipped {name}: the run logged no {needs}")
        else:
            written.append(path)
    return written, skipped


def summary_line(rows: Rows, info: dict[str, Any]) -> str:
    """One line about the run: log steps, env steps, wall time, best return (GRPO: reward),
    time to target."""
    last = rows[-1]
    _, y = series(rows, "rl/episode_return_100")
    grpo = xlabel(info) != "env steps (all ranks)"
    unit = "responses trained" if grpo else "env steps"
    text = f"{len(rows)} log steps, {last['env_steps']:,} {unit} in {last['wall_s']:.0f} s"
    if y.size:
        text += f", last-100 return {y[-1]:.1f} (best {y.max():.1f})"
    _, r = series(rows, "rl/reward")
    if r.size:
        text += f", reward {r[-1]:.3f} (first log {r[0]:.3f}, best {r.max():.3f})"
    if grpo:
        return text
    target = info.get("config", {}).get("target_return")
    if target is not None:
        ret = "rl/episode_return_100"
        hit = next((r for r in rows if (r.get(ret) is not None and r[ret] >= target)), None)
        if hit is None:
            text += f", target {target:g} not reached"
        else:
            text += f", target {target:g} reached at {hit['env_steps']:,} env steps"
            text += f" ({hit['wall_s']:.0f} s)"
    return text


def newest_run(path: str) -> str:
    """``path`` itself if it holds a ``metrics.jsonl``, else its newest subdirectory that does
    (``outputs`` -> ``outputs/run-<id>``), else ``path`` (the report then names what is missing).
    """
    if os.path.isfile(os.path.join(path, "metrics.jsonl")) or not os.path.isdir(path):
        return path
    runs = [
        os.path.join(path, d)
        for d in os.listdir(path)
        if os.path.isfile(os.path.join(path, d, "metrics.jsonl"))
    ]
    return max(runs, key=lambda d: os.path.getmtime(os.path.join(d, "metrics.jsonl")), default=path)


def main(argv: list[str] | None = None) -> int:
    """The command line: draw the PNGs, print their paths; returns the exit status."""
    ap = argparse.ArgumentParser(
        prog="python -m conduit_dist.report", description="Draw PNGs from a run's metrics.jsonl."
    )
    ap.add_argument(
        "run_dir",
        help="the run's directory, e.g. outputs/run-<id>, or a directory of runs (e.g. "
        "outputs): its newest run with a metrics.jsonl",
    )
    ap.add_argument("--out", default=None, help="where the PNGs go (default RUN_DIR/plots)")
    args = ap.parse_args(argv)
    args.run_dir = newest_run(args.run_dir)
    try:
        rows, info = read_run(args.run_dir)
        written, skipped = _draw(rows, info, args.run_dir, args.out)
    except (FileNotFoundError, ValueError, ImportError) as e:
        print(f"conduit_dist.report: {e}", file=sys.stderr)
        return 2
    print(f"{args.run_dir}: {summary_line(rows, info)}")
    for line in skipped:
        print(line)
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
