"""``python -m conduit_dist.bench per``: prioritized replay, sample + priority update per step.

World size 1 (``python -m``): conduit's ``DataPlane(sampler=cd.Prioritized(...))`` against
TorchRL's ``TensorDictReplayBuffer(LazyTensorStorage(N), PrioritizedSampler(N))`` (which
writes ``"index"`` and ``"_weight"`` into the sample, as conduit returns them), side by side in one
run: the same small transition (two 64-float observations, action, reward, done), the same
capacity (filled first), alpha, beta and eps, batches of 256 and 4096. One step is what a
prioritized DQN does per update: ``fetch(B)`` + ``update_priorities(index, p)`` against
``rb.sample()`` + ``rb.update_priority(index, p)``. TorchRL runs in its own interpreter
(``--peer-python``, default ``.venv-peer/bin/python``, made by ``scripts/peer_env.sh``: its
``PrioritizedSampler`` needs torch 2.14.1's build of its extension); the two alternate, repeat by
repeat, so the machine's drift hits both alike. Both use one torch thread.

Under ``torchrun --nproc_per_node=2``: every rank is a learner of a sharded plane (local
placement, the same global capacity split over the ranks), each fetching ``B`` and updating what
it fetched; rank 0 then times a single process with the global capacity (the other rank idles
at a barrier). Reported per sampled item: the job's step time over the ``world * B`` items it
samples, against the single process's step over its ``B``; and per rank (step against step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import conduit_dist as cd
from conduit_dist.bench.common import TORCHRUN_ENV, emit, number, run_peer
from conduit_dist.bench.store import make_batch

SHAPES = {"obs": [64], "next_obs": [64]}
PEER = os.path.join(os.path.dirname(__file__), "per_peer.py")


def _plane(capacity: int, a: argparse.Namespace) -> cd.DataPlane:
    example = make_batch("small", 1)
    spec = cd.ExperienceSpec.from_batch(example)
    sampler = cd.Prioritized(alpha=a.alpha, beta=a.beta, eps=a.eps)
    plane = cd.DataPlane(spec, capacity, sampler=sampler, placement="local", schedule="sync")
    for at in range(0, capacity, 65536):
        plane.put(make_batch("small", min(65536, capacity - at), seed=at))
        plane.flush()
    return plane


def _time_ours(plane: cd.DataPlane, b: int, a: argparse.Namespace) -> float:
    """Median seconds per ``fetch(b)`` + ``update_priorities`` step (collective when sharded:
    every rank runs the same number of steps per block)."""
    prio = torch.rand(b, generator=torch.Generator().manual_seed(1)) + 0.01

    def step() -> None:
        batch = plane.fetch(b)
        plane.update_priorities(batch["_index"], prio)

    for _ in range(20):
        step()
    t0 = time.perf_counter()
    for _ in range(5):
        step()
    per = max((time.perf_counter() - t0) / 5, 1e-6)
    calls = torch.tensor([max(5, int(a.min_time / per))])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(calls, op=dist.ReduceOp.MAX)  # every rank runs as many rounds
    times = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        for _ in range(int(calls)):
            step()
        times.append((time.perf_counter() - t0) / int(calls))
    return statistics.median(times)


def _peer(a: argparse.Namespace) -> dict[str, float]:
    cfg = {
        "shapes": SHAPES, "capacity": a.capacity, "batches": a.batches, "alpha": a.alpha,
        "beta": a.beta, "eps": a.eps, "repeats": a.repeats, "min_time": a.min_time, "threads": 1,
    }  # fmt: skip
    hint = (
        "create it with scripts/peer_env.sh (torch 2.14.1 + torchrl 0.14.1) or pass --peer-python"
    )
    return run_peer("per", a.peer_python, PEER, cfg, hint)


def _single(a: argparse.Namespace) -> None:
    """World size 1: ours and TorchRL, alternating repeat by repeat."""
    cd.init_distributed()
    ours: dict[int, list[float]] = {b: [] for b in a.batches}
    peer: dict[int, list[float]] = {b: [] for b in a.batches}
    plane = _plane(a.capacity, a)
    torch_peer = ""
    for _ in range(a.rounds):
        for b in a.batches:
            ours[b].append(_time_ours(plane, b, a))
        if not a.no_peer:
            got = _peer(a)
            torch_peer = got.pop("torch")
            for b in a.batches:
                peer[b].append(got[str(b)])
    stats = plane.store_stats()
    plane.close()
    results, summary = [], {}
    for b in a.batches:
        row = {"batch": b, "conduit_step_us": statistics.median(ours[b]) * 1e6}
        if peer[b]:
            row["torchrl_step_us"] = statistics.median(peer[b]) * 1e6
            row["speedup_vs_torchrl"] = row["torchrl_step_us"] / row["conduit_step_us"]
            summary[f"speedup_vs_torchrl_b{b}"] = row["speedup_vs_torchrl"]
        results.append(row)
        print(json.dumps(row), flush=True)
    if a.json_only:
        print(json.dumps({b: statistics.median(ours[b]) for b in a.batches}), flush=True)
        return
    emit(
        "per", results, summary, world=1, capacity=a.capacity, torchrl_torch=torch_peer,
        updates_applied=stats["priority_updates_applied"],
    )  # fmt: skip


def _sharded(a: argparse.Namespace) -> None:
    """Under torchrun: the sharded plane, then one process with the global capacity."""
    cd.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    plane = _plane(a.capacity // world, a)
    ours = {b: _time_ours(plane, b, a) for b in a.batches}
    plane.close()
    single: dict[str, float] = {}
    if rank == 0:
        env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
        env["OMP_NUM_THREADS"] = "1"
        args = [sys.executable, "-m", "conduit_dist.bench", "per", "--json-only", "--no-peer"]
        args += ["--capacity", str(a.capacity), "--rounds", "1", "--repeats", str(a.repeats)]
        args += ["--batches", *map(str, a.batches)]
        out = subprocess.run(args, capture_output=True, text=True, env=env)
        if out.returncode != 0:
            raise SystemExit(f"bench per: the single process failed:\n{out.stderr[-3000:]}")
        single = json.loads(out.stdout.strip().splitlines()[-1])
    dist.barrier()
    if rank != 0:
        return
    results, summary = [], {}
    for b in a.batches:
        one = single[str(b)]
        row = {
            "batch": b,
            "sharded_step_us": ours[b] * 1e6,
            "single_step_us": one * 1e6,
            "per_item_vs_single": (ours[b] / (world * b)) / (one / b),
            "per_rank_step_vs_single": ours[b] / one,
        }
        summary[f"per_item_vs_single_b{b}"] = row["per_item_vs_single"]
        results.append(row)
        print(json.dumps(row), flush=True)
    emit("per", results, summary, world=world, capacity=a.capacity)


def main(argv: list[str] | None = None) -> None:
    """Parse options and run the world-size-1 or the sharded comparison."""
    p = argparse.ArgumentParser(prog="python -m conduit_dist.bench per", description=__doc__)
    p.add_argument("--capacity", type=number(int, 1), default=1_000_000, help="items (global)")
    p.add_argument("--batches", type=number(int, 1), nargs="+", default=[256, 4096])
    p.add_argument("--alpha", type=float, default=0.6)
    p.add_argument("--beta", type=float, default=0.4)
    p.add_argument("--eps", type=float, default=1e-6)
    p.add_argument("--repeats", type=number(int, 1), default=5, help="timed blocks per cell")
    p.add_argument("--min-time", type=float, default=0.3, help="seconds per timed block")
    p.add_argument("--rounds", type=number(int, 1), default=3, help="alternations with the peer")
    p.add_argument("--peer-python", default=os.path.join(".venv-peer", "bin", "python"))
    p.add_argument("--no-peer", action="store_true", help="time conduit only")
    p.add_argument("--json-only", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _sharded(a)
    else:
        _single(a)


if __name__ == "__main__":
    main()
