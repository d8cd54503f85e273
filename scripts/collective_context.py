"""What one small all-to-all costs depending on what ran just before it (docs/sim.md).

Run: ``torchrun --standalone --nproc_per_node=N scripts/collective_context.py`` (N = 2, 3, 4).

The plane's calibration times each collective alone, ranks aligned by a barrier. In a round,
calls run back to back, or right after the round's own Python. This times one 64-byte-per-peer
``alltoall_base`` (as the plane calls it) in four contexts, the slowest rank per sample,
medians over samples, and prints a JSON line (rank 0) with microseconds per call:

- ``alone``: after a barrier (the calibration's setting);
- ``back_to_back``: three calls in a row after a barrier, per call;
- ``after_cpu``: after 0.5 ms of Python on every rank, then a barrier;
- ``other_group``: alone, on a second process group (``bench rounds``' raw replay uses one).
"""

from __future__ import annotations

import datetime
import json
import statistics
import time

import torch
import torch.distributed as dist

SAMPLES, WARMUP, PER_PEER = 60, 5, 64


def _spin(seconds: float) -> None:
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        pass


def main() -> None:
    """Time the four contexts on every rank; rank 0 prints the JSON line."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    other = dist.new_group()
    opts = dist.AllToAllOptions()
    inp = torch.zeros(PER_PEER * world, dtype=torch.uint8)
    out = torch.empty_like(inp)
    split = [PER_PEER] * world

    def call(group) -> None:
        group.alltoall_base(out, inp, split, split, opts).wait()

    def sample(calls: int, group, before=None) -> float:
        if before is not None:
            before()
        dist.barrier()
        t = time.perf_counter()
        for _ in range(calls):
            call(group)
        return (time.perf_counter() - t) / calls

    cases = {
        "alone": (1, dist.group.WORLD, None),
        "back_to_back": (3, dist.group.WORLD, None),
        "after_cpu": (1, dist.group.WORLD, lambda: _spin(5e-4)),
        "other_group": (1, other, None),
    }
    got = {}
    for name, (calls, group, before) in cases.items():
        times = [sample(calls, group, before) for _ in range(SAMPLES)]
        xs = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(xs, op=dist.ReduceOp.MAX)
        got[name] = statistics.median(xs.tolist()[WARMUP:]) * 1e6
    if rank == 0:
        print(json.dumps({"world": world, "us_per_call": got}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
