"""``train.py`` run in this process (what ``train_run.py`` launches, under ``torchrun`` for
several ranks), reporting where its plane put the rows and, with ``--count-syncs``, the host
syncs of every training iteration (``Trainer._iteration``: act, env step, put, fetch, loss,
priorities, backward, optimizer; the logging and checkpoints between iterations are not
counted), by ``common.SyncWatch``.

    python scripts/gpu_check/train_inproc.py OUT_PREFIX [--count-syncs] [OVERRIDE ...]

Writes ``OUT_PREFIX.rank<RANK>.json``: ``iterations`` (``[torch syncs, library syncs,
learning]`` per iteration), the library's syncs by reason, the call sites of torch's, and the
plane's ``device_plan`` and first tier (DQN and PPO; GRPO's token plane has none).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

from common import SyncWatch

ROOT = Path(__file__).resolve().parents[2]


def instrument(watch: SyncWatch | None, report: dict[str, object]) -> None:
    """Count each DQN iteration's syncs (``watch``) and note the plane's devices in ``report``
    when the run ends (before the trainer closes its plane)."""
    from conduit_dist.plane.core import DataPlane
    from conduit_dist.train.trainer import Trainer

    iteration, run = Trainer._iteration, Trainer.run
    learning: list[bool] = []

    def counted(self, window) -> None:
        if type(self) is not Trainer or watch is None:
            return iteration(self, window)
        with watch.count():
            iteration(self, window)
        learning.append(self.env_steps >= self.cfg.algo.learning_starts)

    def noted(self):
        summary = run(self)
        plane = getattr(self, "plane", None)
        if isinstance(plane, DataPlane):
            plan = plane.device_plan
            report.update(
                device=str(plane.device), rows=str(plan.rows), tier=str(plan.tier),
                bulk=plan.bulk, compose=plan.compose, schedule=plan.schedule,
                first_tier=plane.store_stats()["tiers"][0]["kind"],
            )  # fmt: skip
        if watch is not None:
            report["iterations"] = [
                [t, lib, learn] for t, lib, learn in zip(watch.torch, watch.library, learning)
            ]
            report["reasons"] = dict(watch.reasons)
            report["sites"] = watch.sites.most_common(8)
        return summary

    Trainer._iteration, Trainer.run = counted, noted


def main() -> None:
    """Run ``train.py`` with the overrides, instrumented, and write the report."""
    args = sys.argv[1:]
    prefix, count = args[0], "--count-syncs" in args
    overrides = [a for a in args[1:] if a != "--count-syncs"]
    report: dict[str, object] = {}
    instrument(SyncWatch() if count else None, report)
    train = str(ROOT / "train.py")
    sys.argv = [train, *overrides]
    try:  # as `python train.py ...`: its __main__ block (Hydra finds conf/ beside the file)
        runpy.run_path(train, run_name="__main__")
    finally:
        rank = os.environ.get("RANK", "0")
        Path(f"{prefix}.rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
