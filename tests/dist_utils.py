"""Run a function on several real gloo ranks (spawned processes) and collect results or errors."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
_STRIPPED = ("WANDB_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC_", "GROUP_")


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child ``python`` or ``torchrun``: the caller's without a torchrun
    rank's or W&B's variables, one torch thread, unbuffered output, the working tree first on
    the path (what ``pip install -e .`` gives a fresh clone), then ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_STRIPPED)}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def _worker(fn, rank, world, init_file, timeout_s, queue, args):  # pragma: no cover - child
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
        result = fn(rank, world, *args)
        queue.put((rank, "ok", result))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout_s: float = 90.0,
    collective_timeout_s: float = 30.0,
    allow_failure: bool = False,
) -> dict[int, Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo ranks.

    Returns ``{rank: result}``. Raises ``AssertionError`` with the child's traceback if a rank
    fails (unless ``allow_failure``: then failures come back as ``("error", traceback)``), and
    ``TimeoutError`` if the ranks do not finish within ``timeout_s`` (all are killed).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker,
                args=(fn, r, world, init_file, collective_timeout_s, queue, args),
                daemon=True,
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(results) < world:
                try:
                    rank, status, value = queue.get(timeout=0.5)
                except queue_mod.Empty:
                    gone = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
                    if gone and queue.empty():
                        for r in gone:
                            results[r] = ("exited", procs[r].exitcode)
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"ranks did not finish in {timeout_s}s; finished: {sorted(results)}"
                        ) from None
                    continue
                if status == "error" and not allow_failure:
                    raise AssertionError(f"rank {rank} failed:\n{value}")
                results[rank] = value if status == "ok" else ("error", value)
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    return results
