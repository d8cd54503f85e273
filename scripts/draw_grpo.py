"""Draw GRPO's reward against responses trained: ``train.py experiment=grpo`` colocated and
disaggregated, and the single-process reference, one line per seed (docs/img/grpo_reward.png).

Usage::

    python scripts/draw_grpo.py RUNS_DIR [--out docs/img/grpo_reward.png]

``RUNS_DIR`` holds ``coloc_s<seed>/`` and ``disagg_s<seed>/`` (train.py run directories, with
``metrics.jsonl``) and ``ref_s<seed>.jsonl`` (``scripts/grpo_reference.py --out``), as
``docs/grpo.md``'s commands write them. Every curve is the mean reward of the responses scored
in each log window (25 global batches of 128 responses).
"""

from __future__ import annotations

import argparse
import glob
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


def _train(path: str) -> tuple[list[float], list[float]]:
    rows = _rows(os.path.join(path, "metrics.jsonl"))
    return [r["env_steps"] for r in rows], [r["rl/reward"] for r in rows]


def _reference(path: str) -> tuple[list[float], list[float]]:
    rows = [r for r in _rows(path) if "reward_window" in r]
    return [r["trained_samples"] for r in rows], [r["reward_window"] for r in rows]


def main() -> None:
    """Parse the command line and draw."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs")
    p.add_argument("--out", default="docs/img/grpo_reward.png")
    a = p.parse_args()
    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=110)
    kinds = [
        ("coloc_s*/", _train, "tab:blue", "colocated, 2 ranks (train.py)"),
        ("disagg_s*/", _train, "tab:orange", "1 learner + 2 generators (train.py)"),
        ("ref_s*.jsonl", _reference, "tab:gray", "single process, no plane (reference)"),
    ]
    for pattern, read, color, label in kinds:
        paths = sorted(glob.glob(os.path.join(a.runs, pattern)))
        for i, path in enumerate(paths):
            x, y = read(path.rstrip("/"))
            ax.plot([v / 1e3 for v in x], y, color=color, lw=1, alpha=0.8,
                    label=f"{label}, {len(paths)} seeds" if i == 0 else None)  # fmt: skip
    ax.set_xlabel("responses trained (thousands, all learners)")
    ax.set_ylabel("mean reward (0..1)")
    ax.set_ylim(0, 1)
    ax.set_title("GRPO, digit reversal: reward vs responses trained (a line per seed)", fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(a.out)
    print(a.out)


if __name__ == "__main__":
    main()
