"""Time the steps of a fused round with a wrapper around each (rank 0 of 2, medians).

Each rank puts 8 DQN-sized items and fetches 128 (``bench rounds``'s ``fused`` case), 300
rounds of warm-up then 3,000 timed; every listed method is wrapped with ``perf_counter`` (the
wrapper adds ~0.5 us a call, nested steps include their children). A before/after probe of the
round's Python, not a benchmark against a baseline (``bench rounds`` is); run it on two
checkouts, alternating, since the machine's speed moves between runs:

    PYTHONPATH=. torchrun --standalone --nproc_per_node=2 scripts/round_steps.py [REDUCE_NUMEL]

With ``REDUCE_NUMEL`` (e.g. 17282, DQN's gradients: ``bench rounds``'s ``fused_grads``) every
fetch carries a ``reduce`` payload of that many floats. With ``main_job`` after it, the round is
``bench rounds``'s ``main_job`` case (3-step prioritized windows, 64 rows a learner, priority
updates after each fetch) and the sampler's steps are timed too:

    PYTHONPATH=. torchrun --standalone --nproc_per_node=2 scripts/round_steps.py 17282 main_job
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
from conduit_dist.bench.rounds import _batch, _main_job_sampler

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
MAIN_JOB_STEPS = (  # the windowed prioritized sampler's side of a round, and the learner's
    "sampling.prioritized.Prioritized.local_meta",
    "sampling.prioritized.Prioritized._sync",
    "sampling.variants.WindowedPrioritized._enter",
    "sampling.sequences.Episodes.ingest",
    "sampling.sequences.Episodes._starts",
    "sampling.sequences.Episodes._gather",
    "sampling.sequences.Episodes._sources",
    "sampling.sumtree.SumTree.fill",
    "sampling.sequences.Episodes.windows",
    "sampling.prioritized.Prioritized._tag",
    "sampling.variants.RoutedPrioritized._apply",
    "sampling.prioritized.Prioritized.allocate",
    "sampling.prioritized.Prioritized.draw",
    "sampling.variants.WindowedPrioritized.write_rows",
    "sampling.sequences.Episodes.compose",
    "sampling.variants.WindowedPrioritized.read_rows",
    "plane.consumer.Consumer.update_priorities",
    "plane.producer.Stager.put",
)


def _wrap(times: dict[str, list[float]], steps: tuple[str, ...]) -> None:
    """Replace each step by a timed wrapper that appends its seconds to ``times``."""
    for path in steps:
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
    main_job = sys.argv[2:] == ["main_job"]
    payload = torch.randn(numel) if numel else None
    times: dict[str, list[float]] = {}
    _wrap(times, STEPS + MAIN_JOB_STEPS if main_job else STEPS)
    cd.init_distributed()
    torch.set_num_threads(1)
    plane = cd.DataPlane(
        cd.ExperienceSpec.from_batch(_batch(1, streams=main_job)),
        50_000,
        placement="local",
        schedule="sync",
        reduce_numel=numel,
        sampler=_main_job_sampler() if main_job else "uniform",
    )
    batch, size = _batch(8, streams=main_job), 64 if main_job else 128
    priorities = torch.rand(size)

    def iteration() -> None:
        plane.put(batch)
        b = plane.fetch(size, reduce=payload)
        if main_job:
            plane.update_priorities(b["_index"], priorities)

    for _ in range(20):
        plane.put(batch)
    for _ in range(300):
        iteration()
    times.clear()
    rounds = 3000
    for _ in range(rounds):
        iteration()
    if dist.get_rank() == 0:
        for key, seconds in times.items():
            med = statistics.median(seconds) * 1e6
            print(f"{key:36s} {len(seconds) / rounds:4.1f} a round, median {med:7.1f} us")
    plane.close()


if __name__ == "__main__":
    main()
