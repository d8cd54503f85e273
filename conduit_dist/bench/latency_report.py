"""The latency benchmark's report: the plot, each setting's printed medians, the summary's cuts."""

from __future__ import annotations

import statistics

from conduit_dist.bench.latency_workload import MODES, PUTS
from conduit_dist.extras import require


def plot(results: dict[str, dict], path: str) -> None:
    """Write the PNG of per-iteration exposed (red) and hidden (green) time of every (learner,
    put, mode) setting to ``path``.

    Raises:
        ModuleNotFoundError: without matplotlib (the ``[bench]`` extra), saying so.
    """
    with require("bench", "the latency bench's plot"):
        import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = [(put, mode) for put in PUTS for mode in MODES]
    fig, axes = plt.subplots(2, len(cols), figsize=(6 * len(cols), 7), sharey="row")
    for row, learner in enumerate(("cpu", "offcpu")):
        for col, (put, mode) in enumerate(cols):
            ax, r = axes[row][col], results[learner][put][mode]
            x = range(len(r["exposed"]))
            ax.bar(x, r["exposed"], color="tab:red", label="exposed (learner waits)")
            ax.bar(x, r["hidden"], bottom=r["exposed"], color="tab:green", label="hidden")
            ax.set_title(
                f"{learner}, {put} put, {mode}: median iteration "
                f"{statistics.median(r['iter']):.1f} ms"
            )
            ax.set_xlabel("iteration")
        axes[row][0].set_ylabel("experience path, ms")
    axes[0][-1].legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def cuts(median: dict) -> dict[str, float]:
    """1 - overlap / sync of the exposed wait and the iteration, for one (learner, put kind)."""
    s, o = median["sync"], median["overlap"]
    return {
        "exposed_cut": 1 - o["exposed"] / s["exposed"],
        "iteration_cut": 1 - o["iter"] / s["iter"],
    }


def report(cpu: dict, off: dict) -> dict:
    """Print each setting's medians; the summary's cuts per put kind and learner."""
    summary: dict = {
        put: {"offcpu": cuts(off["median"][put]), "cpu": cuts(cpu["median"][put])} for put in PUTS
    }
    for name, r in (("cpu", cpu), ("offcpu", off)):
        for put in PUTS:
            for m in MODES:
                v = r["median"][put][m]
                print(
                    f"{name}_{put}_{m}: iteration {v['iter']:.1f} ms, exposed "
                    f"{v['exposed']:.2f} ms, hidden {v['hidden']:.2f} ms, put {v['put']:.2f} ms "
                    f"(items {r['items'][put]}, compute {r['compute_ms']:.1f} ms)"
                )
    for prefix, learner in (("", "cpu"), ("offcpu_", "offcpu")):  # the older keys: donated
        summary[f"{prefix}exposed_reduction"] = summary["donated"][learner]["exposed_cut"]
        summary[f"{prefix}iteration_reduction"] = summary["donated"][learner]["iteration_cut"]
    return summary


def report_dqn(dqn: dict, summary: dict) -> None:
    """Print the DQN medians per schedule; add their cuts (``dqn_*_reduction``) to ``summary``."""
    for m in ("sync", "overlap", "auto"):
        d = dqn[m]
        print(f"dqn_{m}: iteration {d['iteration_ms']:.2f} ms, exposed {d['exposed_ms']:.3f}")
    sync = dqn["sync"]
    summary["dqn_exposed_reduction"] = 1 - dqn["overlap"]["exposed_ms"] / sync["exposed_ms"]
    summary["dqn_iteration_reduction"] = 1 - dqn["overlap"]["iteration_ms"] / sync["iteration_ms"]
    summary["dqn_auto_iteration_reduction"] = 1 - dqn["auto"]["iteration_ms"] / sync["iteration_ms"]
