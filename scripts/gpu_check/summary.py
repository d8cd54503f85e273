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
    out = os.environ["GPU_CHECK_OUT"]
    with open(os.path.join(out, "results.jsonl")) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    wall = time.time() - start
    summary = {
        "gpu_check": "cpu-dry-run (not a GPU check)" if DRY else "ok",
        "device": "cpu" if DRY else torch.cuda.get_device_name(0),
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
