"""Step (s) of the GPU check: ``sanitizer.py`` under the CUDA sanitizer, its output read.

Runs ``torchrun --standalone --nproc_per_node=NPROC scripts/gpu_check/sanitizer.py`` with
``TORCH_CUDA_SANITIZER=1`` (2 ranks share the GPU with ``CONDUIT_CUDA_BACKEND=gloo``), keeps its
output in ``$GPU_CHECK_OUT/sanitizer-NPROC.log`` and passes only if it exited 0 and no line says
:data:`RACE` (the sanitizer prints each race it finds, with the stacks of both accesses, and
raises in the thread that launched the kernel; a race on a package thread fails that round,
which re-raises at the next call).

    python scripts/gpu_check/sanitize.py NPROC

In a dry run the sanitizer is not set (it needs CUDA): the same run and the same reading.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from common import DRY, ok

HERE = Path(__file__).resolve().parent
RACE = "CSAN detected a possible data race"


def command(nproc: int) -> list[str]:
    """``sanitizer.py`` under ``torchrun`` with ``nproc`` ranks."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", str(HERE / "sanitizer.py"),
    ]  # fmt: skip


def verdict(rc: int, output: str) -> str | None:
    """Why the run failed (``None``: it passed)."""
    races = sum(RACE in line for line in output.splitlines())
    if races:
        return f"{races} possible data race(s) reported (exit code {rc})"
    if rc != 0:
        return f"exit code {rc}"
    return None


def main() -> None:
    """Run the sanitizer's scenarios with ``NPROC`` ranks and read the output."""
    nproc = int(sys.argv[1])
    env = dict(os.environ)
    if not DRY:
        env["TORCH_CUDA_SANITIZER"] = "1"
    if nproc > 1:  # ranks sharing one GPU: NCCL refuses that, gloo carries CUDA tensors
        env["CONDUIT_CUDA_BACKEND"] = "gloo"
    t0 = time.perf_counter()
    res = subprocess.run(command(nproc), env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    output = res.stdout + res.stderr
    out_dir = os.environ.get("GPU_CHECK_OUT")
    if out_dir:
        Path(out_dir, f"sanitizer-{nproc}.log").write_text(output)
    sys.stdout.write(res.stdout)  # the scenarios' own ok lines
    why = verdict(res.returncode, output)
    if why is not None:
        sys.stderr.write(output[-8000:])
        raise SystemExit(f"sanitizer, {nproc} rank(s): {why}")
    flag = "" if DRY else "TORCH_CUDA_SANITIZER=1, "
    ok(
        f"s.{nproc}.sanitizer",
        f"{flag}{nproc} rank(s): exit 0, no {RACE!r} in {len(output.splitlines())} lines of "
        f"output ({wall:.0f} s)",
        wall_s=wall,
    )


if __name__ == "__main__":
    main()
