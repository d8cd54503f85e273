"""Step (c) of the GPU check: NCCL at world size 1 under torchrun.

The default group and a plane's own group are ``cpu:gloo,cuda:nccl``: CPU tensors go to gloo,
CUDA tensors to NCCL. A plane at world size 1 has nothing to exchange and builds no group, so
the group a plane builds at world size > 1 is made here by the same function
(``collectives.dist.plane_group``) and checked: the backend each device type maps to, and the
rounds' collectives (all-to-all, broadcast, all-reduce) on CPU and on CUDA tensors. A plane over
a device and a host tier then takes puts from the host and from the GPU and delivers them on
the GPU while DDP over the NCCL default group runs its steps.

    torchrun --standalone --nproc_per_node=1 scripts/gpu_check/nccl_world1.py
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from common import DEVICE, DRY, check, items, ok, tier, verify

import conduit_dist as cd
from conduit_dist.collectives.dist import plane_group


def backends(group: dist.ProcessGroup) -> dict[str, str]:
    """The backend each device type's tensors go to in ``group``."""
    out = {}
    for kind in ("cpu", "cuda"):
        try:
            out[kind] = group._get_backend(torch.device(kind)).name().lower()
        except RuntimeError:
            out[kind] = "none"
    return out


def groups(dev: torch.device) -> str:
    """The default group's and a plane group's backends, and collectives on each device."""
    group = plane_group(timedelta(seconds=60), None if DRY else dev, "nccl")
    want = {"cpu": "gloo", "cuda": "gloo" if DRY else "nccl"}  # (a gloo group takes both)
    got = {"default": backends(dist.group.WORLD), "plane": backends(group)}
    check(got["plane"] == want and got["default"] == want, f"backends {got}, expected {want}")
    for t in (torch.arange(8.0), torch.arange(8.0, device=dev)):  # gloo, then NCCL
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t, group=group)
        dist.broadcast(out, 0, group=group)
        dist.all_reduce(out, group=group)
        check(torch.equal(out, t), f"world-1 collectives on {t.device} changed the values")
    dist.destroy_process_group(group)
    return want["cuda"]


def main() -> None:
    """Run step (c)."""
    check(DRY or torch.cuda.is_available(), "no CUDA device visible")
    check(dist.is_torchelastic_launched(), "run under torchrun (RANK, WORLD_SIZE, MASTER_*)")
    cd.init_distributed(device=DEVICE)
    try:
        spec = cd.ExperienceSpec.from_batch(items(torch.arange(1)))
        storage = cd.Tiers([(tier("device"), 512), ("host", 512)])
        plane = cd.DataPlane(spec, 1024, seed=0, device=DEVICE, schedule="overlap", storage=storage)
        dev = plane.device
        cuda_backend = groups(dev)
        ok("c.groups", f"default and plane groups: CPU tensors to gloo, CUDA to {cuda_backend}")

        model = torch.nn.Linear(spec.fields["obs"].numel, 1).to(dev)
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[dev.index] if dev.type == "cuda" else None
        )
        plane.attach(ddp)
        rows = 0
        for it in range(8):
            plane.put(items(torch.arange(256) + 1000 * it))  # from the host
            plane.put(items(torch.arange(500, 756) + 1000 * it, dev))  # from the GPU
            b = plane.fetch(128)
            rows += verify(b, dev)
            ddp(b["obs"].flatten(1).float()).sum().backward()
        plane.close()
        ok("c.plane", f"plane on {dev} under torchrun: host and GPU puts, {rows} rows checked, DDP")
    finally:
        cd.destroy_distributed()


if __name__ == "__main__":
    main()
