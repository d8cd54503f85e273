"""Time the steps of a fused round with a wrapper around each (rank 0 of 2, medians).

Each rank puts 8 DQN-sized items and fetches 128 (``bench rounds``'s ``fused`` case), 300
rounds of warm-up then 3,000 timed; every listed method is wrapped with ``perf_counter`` (the
wrapper adds ~0.5 us a call, nested steps include their children). A before/after probe of the
round's Python, not a benchmark against a baseline (``bench rounds`` is); run it on two
checkouts, alternating, since the machine's speed moves between runs:

    PYTHONPATH=. torchrun --standalone --nproc_per_node=2 scripts/round_steps.py [REDUCE_NUMEL]

With ``REDUCE_NUMEL`` (e.g. 17282, DQN's gradients: ``bench rounds``'s ``fused_grads``) every
fetch carries a ``reduce`` payload of that many floats.
"""

from __future__ import annotations

import functools
import importlib
import statistics
import sys
import time

import torch
import torch.distributed as dist

import conduit_dist as cd
from conduit_dist.bench.rounds import _batch

STEPS = (
    "sched.overlap.OverlapController.fetch",
    "rounds.engine.RoundEngine._launch",
    "rounds.engine.RoundEngine._finish",
    "rounds.engine.RoundEngine.allocate",
    "rounds.engine.RoundEngine.deliver",
    "rounds.headers.HeaderExchange.launch",
    "rounds.headers.HeaderExchange.land",
    "rounds.headers.HeaderExchange.take",
    "rounds.wire.WireLayout.pack",
    "rounds.wire.WireLayout.unpack",
    "rounds.wire.WireLayout.average",
    "collectives.shm.SharedMemory.start",
    "collectives.shm.ShmWork.wait",
    "rounds.delivery.Delivery.own",
    "sampling.uniform.Uniform.allocate",
    "sampling.base.Sampler.draw",
)


def _wrap(times: dict[str, list[float]]) -> None:
    """Replace each step by a timed wrapper that appends its seconds to ``times``."""
    for path in STEPS:
        mod, cls, meth = f"conduit_dist.{path}".rsplit(".", 2)
        owner = getattr(importlib.import_module(mod), cls)
        fn = owner.__dict__[meth]

        def timed(*a, fn=fn, key=f"{cls}.{meth}", **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                times.setdefault(key, []).append(time.perf_counter() - t0)

        setattr(owner, meth, functools.wraps(fn)(timed))


def main() -> None:
    """Run the rounds and print each step's calls a round and median on rank 0."""
    numel = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    payload = torch.randn(numel) if numel else None
    times: dict[str, list[float]] = {}
    _wrap(times)
    cd.init_distributed()
    torch.set_num_threads(1)
    plane = cd.DataPlane(
        cd.ExperienceSpec.from_batch(_batch(1)),
        50_000,
        placement="local",
        schedule="sync",
        reduce_numel=numel,
    )
    batch = _batch(8)
    for _ in range(20):
        plane.put(batch)
    for _ in range(300):
        plane.put(batch)
        plane.fetch(128, reduce=payload)
    times.clear()
    rounds = 3000
    for _ in range(rounds):
        plane.put(batch)
        plane.fetch(128, reduce=payload)
    if dist.get_rank() == 0:
        for key, seconds in times.items():
            med = statistics.median(seconds) * 1e6
            print(f"{key:36s} {len(seconds) / rounds:4.1f} a round, median {med:7.1f} us")
    plane.close()


if __name__ == "__main__":
    main()
