"""Run a function on several real gloo ranks (processes forked from a fork server) and collect
results or errors."""

from __future__ import annotations

import atexit
import gc
import multiprocessing as mp
import os
import queue as queue_mod
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
_STRIPPED = ("WANDB_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC_", "GROUP_")


# Ranks start from a fork server that imported torch, NumPy and the package once (~1.7 s of CPU
# a process when each rank imports them itself, as under "spawn"): a rank is a fresh fork of
# that server (no thread of the test process, no state the test changed) and imports only the
# test's module. Each rank takes the test process's environment of the moment it starts.
_CTX = mp.get_context("forkserver")
# conduit_dist is not preloaded: each rank imports the copy on the test's own sys.path
_CTX.set_forkserver_preload(["torch", "torch.distributed", "numpy"])

# two ranks on this machine, as the tests launch programs under torchrun
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child ``python`` or ``torchrun``: the caller's without a torchrun
    rank's or W&B's variables, one torch thread, unbuffered output, the working tree first on
    the path (what ``pip install -e .`` gives a fresh clone), then ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_STRIPPED)}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def _worker(fn, rank, world, init_file, timeout_s, queue, args, env):  # pragma: no cover - child
    os.environ.clear()  # the test's environment now, not the fork server's at its start
    os.environ.update(env)
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
        # a fork server's child ends with os._exit: run what an interpreter's exit would (the
        # finalizers that unlink a plane's shared-memory files, atexit handlers), so a crash or
        # a leak at teardown shows here as it would in a program
        gc.collect()
        atexit._run_exitfuncs()


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout_s: float = 90.0,
    collective_timeout_s: float = 30.0,
    allow_failure: bool = False,
    exit_s: float = 30.0,
    expect_exit: dict[int, int] | None = None,
) -> dict[int, Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks (processes forked from the fork
    server above, each importing ``fn``'s module as a spawned one would).

    Returns ``{rank: result}``. Fails (``AssertionError``) when a rank raises (with the child's
    traceback; unless ``allow_failure``: then its result is ``("error", traceback)``), when a
    rank dies without reporting, when a rank exits with a non-zero code (also after reporting:
    a crash at teardown, which destroys the process group, collects and runs the exit
    handlers), or when a rank that reported has not exited ``exit_s`` later; raises
    ``TimeoutError`` if the ranks do not report within ``timeout_s``. ``expect_exit``: ranks
    that must exit without reporting, with these codes (a test that kills a rank); they are
    left out of the result. Every child is killed on the way out.
    """
    expect_exit = expect_exit or {}
    ctx = _CTX
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker,
                args=(fn, r, world, init_file, collective_timeout_s, queue, args, dict(os.environ)),
                daemon=True,
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        try:
            results = _collect(procs, queue, world, timeout_s, allow_failure, expect_exit)
            _check_exits(procs, exit_s, expect_exit)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=10)
    return results


def _collect(procs, queue, world, timeout_s, allow_failure, expect_exit) -> dict[int, Any]:
    """Every rank's report; a rank that died without one fails the run (unless expected)."""
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < world - len(expect_exit):
        try:
            rank, status, value = queue.get(timeout=0.5)
        except queue_mod.Empty:
            gone = [
                r
                for r, p in enumerate(procs)
                if not p.is_alive() and r not in results and r not in expect_exit
            ]
            if gone and queue.empty():
                time.sleep(0.5)  # a report sent just before the exit may still be in the pipe
                if queue.empty():
                    codes = {r: procs[r].exitcode for r in gone}
                    raise AssertionError(
                        f"ranks {gone} exited without reporting (exit codes {codes}); "
                        f"reported: {sorted(results)}"
                    ) from None
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"ranks did not finish in {timeout_s}s; finished: {sorted(results)}"
                ) from None
            continue
        if rank in expect_exit:
            raise AssertionError(f"rank {rank} reported {status!r}; it was expected to exit")
        if status == "error" and not allow_failure:
            raise AssertionError(f"rank {rank} failed:\n{value}")
        results[rank] = value if status == "ok" else ("error", value)
    return results


def _check_exits(procs, exit_s: float, expect_exit: dict[int, int]) -> None:
    """Every rank exits within ``exit_s`` of reporting, with code 0 (or its expected code)."""
    deadline = time.monotonic() + exit_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    stuck = [r for r, p in enumerate(procs) if p.is_alive()]
    if stuck:
        raise AssertionError(f"ranks {stuck} reported but did not exit within {exit_s}s")
    bad = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != expect_exit.get(r, 0)}
    if bad:
        raise AssertionError(
            f"ranks exited with unexpected codes {bad} (expected 0, or {expect_exit})"
        )


PROVENANCE = ("commit", "dirty", "torch", "native", "world_size", "cores", "conduit_dist")


def bench_line(stdout: str) -> dict:
    """A benchmark's JSON line (its output's last line), checked to carry its provenance:
    the commit, torch version, native functions, world size and cores (``bench/common.py``)."""
    import json

    line = json.loads(stdout.strip().splitlines()[-1])
    prov = line.get("provenance")
    assert isinstance(prov, dict), f"bench {line.get('bench')}: no provenance in {sorted(line)}"
    missing = [k for k in PROVENANCE if k not in prov]
    assert not missing, f"bench {line.get('bench')}: provenance lacks {missing}"
    assert prov["torch"] and prov["cores"] >= 1 and prov["world_size"] >= 1, prov
    assert set(prov["native"]) == {"built", "native", "missing"}, prov["native"]
    return line


def needs_native(*names: str) -> None:
    """Skip, naming them, where the native extension or any of ``names`` is absent: a test
    comparing the native path with torch's would otherwise compare torch's path with itself."""
    import pytest

    from conduit_dist.records.native import _native

    if _native is None:
        pytest.skip("the native extension is not built (pip install -e .)")
    missing = [n for n in names if not hasattr(_native, n)]
    if missing:
        pytest.skip(f"the native extension lacks {', '.join(missing)} (a stale build)")


def learners_and_attached(
    tmp_path: Path, learner_args: list[str], producer_args: list[str], timeout_s: float = 240
) -> tuple[dict, dict]:
    """``torchrun --nproc_per_node=2 train.py <learner_args>`` and, started right after it,
    ``python train.py <producer_args>`` (a producer attaching from outside the job); both must
    end with status 0. Returns each one's ``done:`` line as a dict (``nan`` read as ``None``)."""
    import ast
    import subprocess

    learners = subprocess.Popen(
        [*TORCHRUN, str(ROOT / "train.py"), *learner_args, f"hydra.run.dir={tmp_path}"],
        cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    producer = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *producer_args,
         f"hydra.run.dir={tmp_path / 'producer'}"],
        cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip
    out, _ = learners.communicate(timeout=timeout_s)
    assert learners.returncode == 0, out[-4000:]
    produced = producer.stdout + producer.stderr
    assert producer.returncode == 0, produced[-4000:]

    def done(text: str) -> dict:
        line = next(x for x in text.splitlines() if "done: {" in x)
        return ast.literal_eval(line.split("done: ", 1)[1].replace("nan", "None"))

    return done(out), done(produced)
