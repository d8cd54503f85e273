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
- ``store_tiers.png``: the store's bytes per tier (mean over shards) vs env steps.

A plot whose metrics the run did not log (e.g. PPO has no tiers) is skipped, saying so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from datetime import datetime, timezone
from typing import Any

import numpy as np

from conduit_dist.collectives.topology import LINKS
from conduit_dist.extras import require

_QUANTILES = (50, 90, 99)
Rows = list[dict[str, Any]]


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


def _series(rows: Rows, key: str) -> tuple[np.ndarray, np.ndarray]:
    """``(env_steps, values)`` of the rows that hold a number for ``key``."""
    pts = [(r["env_steps"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
    arr = np.array(pts, dtype=np.float64).reshape(-1, 2)
    return arr[:, 0], arr[:, 1]


def _has(rows: Rows, *keys: str) -> bool:
    return all(any(isinstance(r.get(k), int | float) for r in rows) for k in keys)


def _figure(title: str, ylabel: str):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.set_title(title, fontsize=11)
    ax.set_xlabel("env steps (all ranks)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _save(fig, out: str, name: str) -> str:
    import matplotlib.pyplot as plt

    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _plot_return(rows: Rows, info: dict[str, Any], out: str) -> str | None:
    key = "rl/episode_return_100"
    if not _has(rows, key):
        return None
    x, y = _series(rows, key)
    target = info.get("config", {}).get("target_return")
    fig, ax = _figure(f"Return (mean of the last 100 episodes), best {y.max():.1f}", "return")
    ax.plot(x, y, color="tab:blue", label="last-100 mean")
    if target is not None:
        ax.axhline(target, color="tab:red", ls="--", lw=1, label=f"target {target:g}")
        hit = np.nonzero(y >= target)[0]
        if hit.size:
            ax.axvline(x[hit[0]], color="tab:red", ls=":", lw=1)
    ax.legend(loc="lower right")
    return _save(fig, out, "return.png")


def _plot_path_time(rows: Rows, info: dict[str, Any], out: str) -> str | None:
    ke, kh = "path/exposed_ms_mean", "path/hidden_ms_mean"
    if not _has(rows, ke, kh):
        return None
    x, exposed = _series(rows, ke)
    hidden = np.array([r.get(kh) or 0.0 for r in rows if isinstance(r.get(ke), int | float)])
    share = hidden.sum() / max(hidden.sum() + exposed.sum(), 1e-12)
    fig, ax = _figure(
        f"Experience path per learner fetch: {share:.0%} of the round hidden", "ms per fetch"
    )
    ax.stackplot(
        x, exposed, hidden, labels=["exposed (the learner waited)", "hidden (behind compute)"],
        colors=["tab:red", "tab:green"], alpha=0.7,
    )  # fmt: skip
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper right")
    return _save(fig, out, "path_time.png")


def _plot_link_bytes(rows: Rows, info: dict[str, Any], out: str) -> str | None:
    keys = [f"path/bytes_{c}" for c in LINKS]
    if not _has(rows, *keys):
        return None
    fig, ax = _figure("Bytes the rounds sent, by link class (all ranks)", "cumulative MB")
    for key, link, color in zip(keys, LINKS, ("tab:gray", "tab:blue", "tab:orange")):
        x, y = _series(rows, key)
        total = np.cumsum(y) / 1e6
        ax.plot(x, total, color=color, label=f"{link}: {total[-1]:,.1f} MB" if total.size else link)
    ax.legend(loc="upper left")
    return _save(fig, out, "link_bytes.png")


_TIER = re.compile(r"^store/tier(\d+)_(\w+)_bytes$")


def _plot_store_tiers(rows: Rows, info: dict[str, Any], out: str) -> str | None:
    found = {k for r in rows for k in r if _TIER.match(k)}
    keys = sorted(found, key=lambda k: int(_TIER.match(k)[1]))
    if not keys:
        return None
    fig, ax = _figure("Store size per tier (mean over shards)", "MB per shard")
    x = np.array([r["env_steps"] for r in rows], dtype=np.float64)
    ys = [np.array([(r.get(k) or 0.0) / 1e6 for r in rows]) for k in keys]
    labels = [f"tier {m[1]} ({m[2]})" for m in (_TIER.match(k) for k in keys)]
    ax.stackplot(x, *ys, labels=labels, alpha=0.7)
    ax.legend(loc="upper left")
    return _save(fig, out, "store_tiers.png")


_PLOTS = (
    ("return.png", _plot_return, "rl/episode_return_100"),
    ("path_time.png", _plot_path_time, "path/exposed_ms_mean and path/hidden_ms_mean"),
    ("link_bytes.png", _plot_link_bytes, "path/bytes_{self,host,net}"),
    ("store_tiers.png", _plot_store_tiers, "store/tier<i>_<kind>_bytes"),
)


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
    for name, plot, needs in _PLOTS:
        path = plot(rows, info, out)
        if path is None:
            skipped.append(f"skipped {name}: the run logged no {needs}")
        else:
            written.append(path)
    return written, skipped


def summary_line(rows: Rows, info: dict[str, Any]) -> str:
    """One line about the run: log steps, env steps, wall time, best return, time to target."""
    last = rows[-1]
    _, y = _series(rows, "rl/episode_return_100")
    text = f"{len(rows)} log steps, {last['env_steps']:,} env steps in {last['wall_s']:.0f} s"
    if y.size:
        text += f", last-100 return {y[-1]:.1f} (best {y.max():.1f})"
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
