"""Time the main job's data path at world size 1: a windowed (3-step) prioritized plane.

One iteration is what the README's main job does per learner step on one rank: ``put`` 8
transitions (one per env stream), ``fetch(64)`` n-step rows, ``update_priorities``. Prints the
median microseconds per iteration over 5 blocks of 1,500 (after 400 puts), then the tensors torch
allocates an iteration (``bench rounds``'s ``TensorAllocations``, over 500 more). A before/after
probe for the per-round bookkeeping, not a benchmark against a baseline (``python -m
conduit_dist.bench per`` is, without windows); run it on two checkouts to compare:

    PYTHONPATH=. python scripts/per_nstep_loop.py
"""

from __future__ import annotations

import statistics
import time

import torch

import conduit_dist as cd
from conduit_dist.bench.rounds import TensorAllocations


def main() -> None:
    """Build the plane, run the loop and print one line."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)

    def batch() -> dict[str, torch.Tensor]:
        n = 8
        return {
            "obs": torch.randn(n, 4, generator=g),
            "next_obs": torch.randn(n, 4, generator=g),
            "action": torch.randint(0, 2, (n,), generator=g),
            "reward": torch.ones(n),
            "done": torch.rand(n, generator=g) < 0.05,
            "truncated": torch.zeros(n, dtype=torch.bool),
            "env": torch.arange(n),
        }

    puts = [batch() for _ in range(64)]
    seq = cd.Windows(n_step=3, gamma=0.99, done="done", truncated="truncated", stream="env")
    sampler = cd.Prioritized(alpha=0.6, beta=0.4, eps=1e-6, sequence=seq)
    spec = cd.ExperienceSpec.from_batch(puts[0])
    plane = cd.DataPlane(spec, 50_000, seed=0, sampler=sampler, schedule="sync")
    for i in range(400):
        plane.put(puts[i % 64])
    blocks = []
    for _ in range(5):
        t0 = time.perf_counter()
        for i in range(1500):
            plane.put(puts[i % 64])
            b = plane.fetch(64)
            plane.update_priorities(b["_index"], torch.rand(64, generator=g))
        blocks.append((time.perf_counter() - t0) / 1500 * 1e6)
    with TensorAllocations() as allocs:  # the plane's own tensors: the priorities made first
        prios = [torch.rand(64, generator=g) for _ in range(64)]
        made = allocs.count
        for i in range(500):
            plane.put(puts[i % 64])
            b = plane.fetch(64)
            plane.update_priorities(b["_index"], prios[i % 64])
    per_iter = (allocs.count - made) / 500
    plane.close()
    print(
        f"per_nstep_loop: {statistics.median(blocks):.1f} us an iteration (median of 5 blocks), "
        f"{per_iter:.1f} tensors allocated an iteration"
    )


if __name__ == "__main__":
    main()
