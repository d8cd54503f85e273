"""Kill one rank with SIGKILL mid-run and check the job resumes from its last checkpoint.

python scripts/kill_resume.py                      # 2 ranks, DQN smoke job, kill rank 1
python scripts/kill_resume.py --steps 40000 --kill-after-s 5
python scripts/kill_resume.py device=cuda plane.calibrate=false   # train.py overrides last

Starts ``torchrun --max-restarts 1 train.py`` with checkpoints every ``--every-iters``
iterations, waits for the first complete checkpoint and then ``--kill-after-s`` more seconds,
sends SIGKILL to one worker, and waits for torchrun to restart the group and the job to finish.
The last stdout line is JSON: the rank killed, env steps at the kill (rank 0's last progress
record) and at the checkpoint resumed from, env steps lost (put after that checkpoint), items
restored, whether the job finished, and the wall times.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _workers(agent: int) -> dict[int, int]:
    """``{local rank: pid}`` of the agent's worker processes."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != agent:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if b"LOCAL_RANK" in env:
            out[int(env[b"LOCAL_RANK"])] = int(pid)
    return out


def _complete(root: str) -> list[str]:
    if not os.path.isdir(root):
        return []
    return sorted(n for n in os.listdir(root) if n.startswith("ckpt-") and "." not in n)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument("--steps", type=int, default=16000, help="total_env_steps of the job")
    ap.add_argument("--every-iters", type=int, default=100)
    ap.add_argument("--kill-after-s", type=float, default=1.0)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    ap.add_argument(
        "overrides", nargs="*", help="more train.py overrides (key=value), e.g. device=cuda"
    )
    args = ap.parse_args()
    work = args.dir or tempfile.mkdtemp(prefix="conduit-kill-")
    os.makedirs(work, exist_ok=True)
    ckdir, summary = os.path.join(work, "ck"), os.path.join(work, "summary.json")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={args.nproc}", "--max-restarts=1", os.path.join(ROOT, "train.py"),
        "experiment=smoke", f"total_env_steps={args.steps}", f"checkpoint.dir={ckdir}",
        f"checkpoint.every_iters={args.every_iters}", "checkpoint.every_s=0",
        "logger.kind=console", "logger.log_every=10", f"logger.summary_path={summary}",
        "plane.timeout_s=20", "plane.capacity_per_rank=20000", f"hydra.run.dir={work}/hydra",
        *args.overrides,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    log_path = os.path.join(work, "job.log")
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        job = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        result: dict[str, object] = {"bench": "kill_resume", "work_dir": work}
        while not _complete(ckdir) and job.poll() is None:
            time.sleep(0.05)
            if time.monotonic() - t0 > args.timeout_s:
                break
        time.sleep(args.kill_after_s)
        workers = _workers(job.pid)
        victim = workers.get(args.kill_rank)
        progress = _read(os.path.join(ckdir, "progress0.json")) or {}
        if victim is None or job.poll() is not None:
            result["error"] = f"no worker of local rank {args.kill_rank} to kill ({workers})"
        else:
            os.kill(victim, signal.SIGKILL)
            result.update(
                killed_rank=args.kill_rank,
                killed_pid=victim,
                killed_at_s=round(time.monotonic() - t0, 2),
                env_steps_at_kill=progress.get("env_steps"),
                checkpoints_at_kill=_complete(ckdir),
            )
        try:
            rc = job.wait(timeout=max(1.0, args.timeout_s - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            job.kill()
            rc = "timeout"
    with open(log_path) as f:
        text = f.read()
    s = _read(summary) or {}
    resumed = s.get("resumed") or {}
    result.update(
        rc=rc,
        wall_s=round(time.monotonic() - t0, 2),
        finished=rc == 0 and s.get("env_steps", 0) >= args.steps,
        env_steps=s.get("env_steps"),
        resumed=resumed,
        items_lost=resumed.get("env_steps_lost"),  # one item per env step (DQN)
        restarted=bool(resumed),  # the restarted attempt found the checkpoint
        round_error_named=[ln.strip()[:300] for ln in text.splitlines() if "RoundError: " in ln][
            :2
        ],
    )
    print(json.dumps(result))
    return 0 if result["finished"] and resumed else 1


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    sys.exit(main())
