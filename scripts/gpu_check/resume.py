"""Step (k) of the GPU check: a rank killed mid-run on the GPU, the job resumed and finished.

Runs ``scripts/kill_resume.py`` (``torchrun --max-restarts 1 train.py experiment=smoke`` with
checkpoints every few iterations; one worker is sent SIGKILL after the first complete
checkpoint; torchrun restarts the group, which resumes from the newest checkpoint) with
``device=cuda`` added to its ``train.py`` command, 2 ranks sharing the GPU
(``CONDUIT_CUDA_BACKEND=gloo``). Checked from its JSON line: a worker was killed, the restarted
job resumed from a checkpoint and finished every env step.

The overrides go to ``kill_resume.py``'s ``train.py`` command after its own arguments.

    python scripts/gpu_check/resume.py [KILL_RESUME ARGS ...]
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
from pathlib import Path

from common import DEVICE, DRY, check, ok

SCRIPTS = Path(__file__).resolve().parents[1]
ARGS = ["--steps", "6000", "--every-iters", "40", "--kill-after-s", "0.5", "--timeout-s", "60"]


def main() -> None:
    """Run ``kill_resume.py`` on the GPU and check its result line."""
    sys.path.insert(0, str(SCRIPTS))
    import kill_resume

    if not DRY:  # 2 ranks sharing one GPU: NCCL refuses that, gloo carries CUDA tensors
        os.environ["CONDUIT_CUDA_BACKEND"] = "gloo"
    work = os.environ.get("GPU_CHECK_OUT")
    args = [*ARGS, *sys.argv[1:]]
    if work and "--dir" not in args:
        args += ["--dir", os.path.join(work, "kill-resume")]
    args += [f"device={DEVICE}", "plane.calibrate=false"]  # train.py overrides: last
    sys.argv = ["kill_resume.py", *args]
    t0 = time.perf_counter()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = kill_resume.main()
    wall = time.perf_counter() - t0
    lines = [line for line in printed.getvalue().splitlines() if line.startswith("{")]
    check(bool(lines), f"kill_resume.py printed no result line: {printed.getvalue()[-2000:]}")
    result = json.loads(lines[-1])
    log = Path(result["work_dir"], "job.log")
    tail = log.read_text()[-4000:] if log.exists() else ""
    check("killed_rank" in result, f"no worker was killed: {result}\n{tail}")
    check(result["restarted"], f"the restarted job did not resume a checkpoint: {result}\n{tail}")
    check(result["finished"] and rc == 0, f"the job did not finish: {result}\n{tail}")
    resumed = result["resumed"]
    ok(
        "k.kill_resume",
        f"train.py device={DEVICE}, 2 ranks: rank {result['killed_rank']} killed at "
        f"{result['killed_at_s']} s ({result['env_steps_at_kill']} env steps), resumed from a "
        f"checkpoint ({resumed.get('env_steps_lost')} env steps lost), finished "
        f"{result['env_steps']} env steps in {wall:.0f} s",
        killed_at_s=result["killed_at_s"],
        env_steps=result["env_steps"],
        env_steps_lost=resumed.get("env_steps_lost"),
        wall_s=wall,
    )


if __name__ == "__main__":
    main()
