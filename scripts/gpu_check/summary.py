"""The GPU check's last line: one JSON object with the machine, every step that printed ``ok``
and its numbers, and the wall time.

    python scripts/gpu_check/summary.py START_EPOCH_S
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from common import DRY

BUDGET_S = 8 * 60  # what the check is sized to on one GPU


def main() -> None:
    """Print the summary line."""
    start = float(sys.argv[1])
    path = os.path.join(os.environ["GPU_CHECK_OUT"], "results.jsonl")
    steps = []
    if os.path.exists(path):  # absent when no step passed (GPU_CHECK_KEEP_GOING=1)
        with open(path) as f:
            steps = [json.loads(line) for line in f if line.strip()]
    wall = time.time() - start
    failed = os.environ.get("GPU_CHECK_FAILED", "").split()  # GPU_CHECK_KEEP_GOING=1's failures
    verdict = "failed" if failed else "ok"
    summary = {
        "gpu_check": "cpu-dry-run (not a GPU check)" if DRY else verdict,
        "failed": failed,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "steps": [s["step"] for s in steps],
        "numbers": {s["step"]: {k: v for k, v in s.items() if k != "step"} for s in steps},
        "wall_s": round(wall, 1),
        "within_budget": wall <= BUDGET_S,
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
