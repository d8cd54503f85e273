"""The GPU check's last line: one JSON object with the machine (device, NVIDIA driver, torch,
CUDA, the commit checked), every step that printed ``ok`` and its numbers, the steps skipped and
why, the failed ones, and the wall time against the budget.

    python scripts/gpu_check/summary.py START_EPOCH_S
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import DRY

BUDGET_S = 10 * 60  # what the check is sized to on one H100 (the sum of its step limits)
ROOT = Path(__file__).resolve().parents[2]


def _first_line(cmd: list[str]) -> str | None:
    """The first line ``cmd`` prints, ``None`` if it cannot run or fails."""
    try:
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = res.stdout.strip().splitlines()
    return lines[0].strip() if res.returncode == 0 and lines else None


def machine() -> dict[str, object]:
    """The device, driver, torch, CUDA and commit of this run."""
    available = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name(0) if available else "cpu",
        "gpus": torch.cuda.device_count() if available else 0,
        "driver": _first_line(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        ),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        # a copied tree without .git: the launcher's GPU_CHECK_COMMIT=$(git rev-parse HEAD)
        "commit": _first_line(["git", "rev-parse", "HEAD"]) or os.environ.get("GPU_CHECK_COMMIT"),
        "dirty": bool(_first_line(["git", "status", "--porcelain", "--untracked-files=no"])),
    }


def main() -> None:
    """Print the summary line."""
    start = float(sys.argv[1])
    path = os.path.join(os.environ["GPU_CHECK_OUT"], "results.jsonl")
    entries = []
    if os.path.exists(path):  # absent when no step passed (GPU_CHECK_KEEP_GOING=1)
        with open(path) as f:
            entries = [json.loads(line) for line in f if line.strip()]
    steps = [e for e in entries if "skipped" not in e]
    wall = time.time() - start
    failed = os.environ.get("GPU_CHECK_FAILED", "").split()  # GPU_CHECK_KEEP_GOING=1's failures
    verdict = "failed" if failed else "ok"
    summary = {
        "gpu_check": "cpu-dry-run (not a GPU check)" if DRY else verdict,
        "failed": failed,
        **machine(),
        "steps": [s["step"] for s in steps],
        "skipped": {e["step"]: e["skipped"] for e in entries if "skipped" in e},
        "numbers": {s["step"]: {k: v for k, v in s.items() if k != "step"} for s in steps},
        "wall_s": round(wall, 1),
        "budget_s": BUDGET_S,
        "within_budget": wall <= BUDGET_S,
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
