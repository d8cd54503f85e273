"""Step (d) of the GPU check: ``train.py device=cuda`` for a few thousand env steps.

Each run is the real ``train.py`` (under ``torchrun`` for several ranks; 2 ranks share one GPU
with gloo carrying the CUDA tensors), with its summary written to JSON and checked: every env
step taken, learner updates made, PPO's items all within its policy-age bound.

    python scripts/gpu_check/train_run.py NAME NPROC [OVERRIDE ...]
    python scripts/gpu_check/train_run.py dqn-2-disaggregated 2 mode=disaggregated
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import DEVICE, check, ok

ROOT = Path(__file__).resolve().parents[2]
COMMON = (
    "logger=none",
    "logger.log_every=10",
    "plane.calibrate=false",  # declared link numbers: no probing at start-up
    "target_return=null",
)


def command(nproc: int, overrides: list[str], out: Path) -> list[str]:
    """``train.py`` (under ``torchrun --standalone`` for ``nproc >= 1``, plain ``python`` for
    ``nproc == 0``) with the check's overrides."""
    launch = [sys.executable]
    if nproc:
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [
        *launch,
        str(ROOT / "train.py"),
        f"device={DEVICE}",
        *COMMON,
        *overrides,
        f"logger.summary_path={out / 'summary.json'}",
        f"hydra.run.dir={out}",
    ]


def main() -> None:
    """Run one ``train.py`` job and check its summary."""
    name, nproc, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    out = Path(tempfile.mkdtemp(prefix=f"train-{name}-", dir=os.environ.get("GPU_CHECK_OUT")))
    env = dict(os.environ)
    if nproc > 1:  # ranks sharing one GPU: NCCL refuses that, gloo carries CUDA tensors
        env["CONDUIT_CUDA_BACKEND"] = "gloo"
    t0 = time.perf_counter()
    res = subprocess.run(
        command(nproc, overrides, out), cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        sys.stderr.write(res.stdout[-6000:] + res.stderr[-6000:])
        raise SystemExit(f"train.py {name}: exit code {res.returncode} after {wall:.0f} s")
    summary = json.loads((out / "summary.json").read_text())
    steps = next(int(o.split("=")[1]) for o in overrides if o.startswith("total_env_steps="))
    check(summary["env_steps"] >= steps, f"{name}: {summary['env_steps']} env steps of {steps}")
    if "max_policy_age_seen" in summary:  # PPO: every item within algo.ppo.max_policy_age=0
        check(summary["max_policy_age_seen"] == 0, f"{name}: policy age {summary}")
        learned = summary["train/policy_version"] >= 1  # rank 0 learns: one per update
    else:  # DQN: rank 0 is a learner in both modes
        learned = summary["learner_steps"] > 0
    check(learned, f"{name}: no learner update in {summary}")
    ret = summary["return_100"]
    ok(
        f"d.train.{name}",
        f"train.py device={DEVICE} {' '.join(overrides)}: {summary['env_steps']} env steps in "
        f"{wall:.0f} s ({summary['env_steps_per_s']:.0f}/s), last-100 return "
        f"{ret if not math.isnan(ret) else 'n/a'}",
        wall_s=wall,
        env_steps=summary["env_steps"],
        env_steps_per_s=summary["env_steps_per_s"],
    )


if __name__ == "__main__":
    main()
