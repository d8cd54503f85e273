"""Step (g) of the GPU check, on a machine with two GPUs or more: NCCL between ranks.

Two ranks, one GPU each (``cuda:<LOCAL_RANK>``), the plane's CUDA tensors on NCCL (the
default: no ``CONDUIT_CUDA_BACKEND``). Checked:

- device mapping: each rank's plane and every delivered tensor on ``cuda:<LOCAL_RANK>``;
- the device plan: rows on that GPU, bulk rows by ``nccl``, an NCCL communicator, every round on
  the round thread;
- exactness between ranks: for uniform (``local`` and ``round_robin``), prioritized (with GPU
  priorities) and n-step windows, the NCCL plane's batches equal, byte for byte, those of a CPU
  plane rehearsing the device-rows path (``CONDUIT_DEVICE_ROWS_REHEARSAL=1``: the same logic on
  host tensors, bulk rows over gloo) fed the same puts with the same seed;
- an overlapped NCCL round: launched at backward, run on ``conduit-round_0``, the hook held
  until its bulk exchange is enqueued (``stats.gate_ms``), and its exposed and hidden
  milliseconds (``plane.last_fetch``), printed.

``scripts/gpu_check.sh`` runs it only where ``torch.cuda.device_count() >= 2``.

    torchrun --standalone --nproc_per_node=2 scripts/gpu_check/two_gpus.py
"""

from __future__ import annotations

import os
import statistics

import torch
import torch.distributed as dist
from common import DEVICE, DRY, check, items, ok, rehearsal, stream_ids, verify

import conduit_dist as cd
from conduit_dist.sampling.base import RoutesFeedback

SAMPLERS = {
    "uniform local": ("uniform", "local"),
    "uniform round_robin": ("uniform", "round_robin"),
    "prioritized": (lambda: cd.Prioritized(alpha=0.6, beta=0.4), None),
    "n_step": (
        lambda: cd.Prioritized(
            alpha=0.6, beta=0.4, sequence=cd.Windows(n_step=3, gamma=0.9, stream="env")
        ),
        None,
    ),
}
ITERS, WARM = (5, 2) if DRY else (10, 3)  # fetches compared per sampler, after WARM


def _batch(rank: int, t: int) -> dict[str, torch.Tensor]:
    """Step ``t`` of 16 streams of this rank, 4 steps each (host tensors)."""
    steps = torch.arange(4 * t, 4 * t + 4)
    return items(torch.cat([stream_ids(rank, e, steps) for e in range(16)]))


def _plane(name: str, device: str, rehearse: bool) -> cd.DataPlane:
    sampler, placement = SAMPLERS[name]
    spec = cd.ExperienceSpec.from_batch(_batch(0, 0))
    with rehearsal(rehearse):
        return cd.DataPlane(
            spec, 2048, seed=51, device=device, schedule="sync", placement=placement,
            sampler=sampler() if callable(sampler) else sampler,
        )  # fmt: skip


def _batches(plane: cd.DataPlane, rank: int) -> list[dict[str, torch.Tensor]]:
    feedback, out = isinstance(plane.sampler, RoutesFeedback), []
    for t in range(WARM + ITERS):
        plane.put(_batch(rank, t))
        if t < WARM:
            plane.flush()
            continue
        b = plane.fetch(32)
        verify(b, plane.device)
        if feedback:
            plane.update_priorities(b["_index"], (b["_index"] % 7).double() * 0.5 + 0.25)
        out.append({k: v.to("cpu", copy=True) for k, v in b.items()})
    return out


def mapping_and_exactness(rank: int, local: int) -> None:
    """Each rank on its GPU, bulk rows by NCCL, and the NCCL plane's batches equal the
    rehearsal's."""
    want_dev = torch.device("cpu") if DRY else torch.device("cuda", local)
    for name in SAMPLERS:
        plane = _plane(name, DEVICE, rehearse=DRY)
        plan = plane.device_plan
        check(plane.device == want_dev, f"rank {rank}: plane on {plane.device}, not {want_dev}")
        check(plan.rows == plane.device, f"rank {rank}, {name}: rows on {plan.rows}")
        bulk = "host" if DRY else "nccl"
        check(plan.bulk == bulk and plan.round_thread and plan.nccl == (not DRY),
              f"rank {rank}, {name}: {plan}")  # fmt: skip
        got = _batches(plane, rank)
        plane.close()
        ref = _plane(name, "cpu", rehearse=True)
        want = _batches(ref, rank)
        ref.close()
        for i, (a, b) in enumerate(zip(want, got)):
            for key in a:
                check(torch.equal(a[key], b[key]), f"rank {rank}, {name}, fetch {i}: {key!r} "
                      "differs from the rehearsal's")  # fmt: skip
    ok(
        "g.exact",
        f"2 ranks, rank r on {'cpu' if DRY else 'cuda:<r>'}, bulk rows by "
        f"{'host' if DRY else 'nccl'}: {', '.join(SAMPLERS)} equal the device-rows rehearsal's "
        f"batches ({ITERS} fetches each)",
    )


def overlapped_nccl(rank: int) -> None:
    """An overlapped plane whose rounds go by NCCL: thread, gate, exposed and hidden time."""
    spec = cd.ExperienceSpec.from_batch(_batch(0, 0))
    with rehearsal(DRY):  # a dry run: the device-rows path's round thread and gate on the CPU
        plane = cd.DataPlane(spec, 2048, seed=52, device=DEVICE, schedule="overlap")
    model = torch.nn.Linear(spec.fields["obs"].numel, 1).to(plane.device)
    plane.attach(model)
    threads, gates, exposed, hidden = set(), [], [], []
    for t in range(WARM + 2 * ITERS):
        plane.put(_batch(rank, t))
        b = plane.fetch(64)
        verify(b, plane.device)
        if t >= WARM:
            timing = plane.last_fetch
            threads.add(plane.stats.thread)
            gates.append(plane.stats.gate_ms)
            exposed.append(timing.exposed_ms)
            hidden.append(timing.hidden_ms)
        model(b["obs"].flatten(1).float()).sum().backward()
    schedule = plane.chosen_schedule
    plane.close()
    check(threads == {"conduit-round_0"}, f"rank {rank}: rounds ran on {threads}")
    check(all(g >= 0 for g in gates), f"rank {rank}: gate times {gates}")
    ok(
        "g.overlap",
        f"{schedule} rounds on conduit-round_0, bulk by {'host' if DRY else 'nccl'}: median "
        f"exposed {statistics.median(exposed):.3f} ms, hidden {statistics.median(hidden):.3f} "
        f"ms, gate {statistics.median(gates):.3f} ms per fetch",
        exposed_ms=statistics.median(exposed),
        hidden_ms=statistics.median(hidden),
        gate_ms=statistics.median(gates),
    )


def main() -> None:
    """Run step (g)."""
    check(DRY or torch.cuda.device_count() >= 2, "fewer than 2 GPUs visible")
    cd.init_distributed(device=DEVICE)
    try:
        rank, local = dist.get_rank(), int(os.environ["LOCAL_RANK"])
        check(dist.get_world_size() == 2, f"expected 2 ranks, got {dist.get_world_size()}")
        mapping_and_exactness(rank, local)
        overlapped_nccl(rank)
    finally:
        cd.destroy_distributed()


if __name__ == "__main__":
    main()
