"""Step (c) of the GPU check: NCCL at world size 1 under torchrun.

The default group and a plane's own group are ``cpu:gloo,cuda:nccl``: CPU tensors go to gloo,
CUDA tensors to NCCL. A plane at world size 1 has nothing to exchange and builds no group, so
the group a plane builds at world size > 1 is made here by the same function
(``collectives.dist.plane_group``) and checked: the backend each device type maps to, and the
rounds' collectives (all-to-all, broadcast, all-reduce) on CPU and on CUDA tensors. A plane over
a device and a host tier then takes puts from the host and from the GPU and delivers them on
the GPU while DDP over the NCCL default group runs its steps.

Then the plane's ``Exchange`` over such a group, with a long kernel queued on the stream ahead
of its all-to-all: ``all_to_all_async(...).wait()`` must return on the host while the kernel
still runs (the wait orders the current stream after the collective, on the device: no host
polling), the values must be right once the stream has passed it, and ``Exchange.close()`` with
such work queued must return within :data:`CLOSE_S` of the kernel's end.

    torchrun --standalone --nproc_per_node=1 scripts/gpu_check/nccl_world1.py
"""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from common import DEVICE, DRY, check, gpu_sleep, items, ok, sleep_rate, tier, verify

import conduit_dist as cd
from conduit_dist.collectives.dist import plane_group
from conduit_dist.collectives.exchange import Exchange

SLEEP_S = 2.0  # the kernel queued ahead of the all-to-all
WAIT_S = 0.25  # the most a device-side wait may take on the host (the kernel runs 8x longer)
CLOSE_S = 30.0  # the most close() may take past the kernel's end


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


def _exchange(dev: torch.device) -> Exchange:
    """The plane's ``Exchange`` over a plane group built as at world size > 1."""
    group = plane_group(timedelta(seconds=60), None if DRY else dev, "nccl")
    return Exchange(60.0, group=group, name="gpu-check-wait", device=dev)


def device_wait(dev: torch.device) -> None:
    """A wait on a CUDA all-to-all returns while a long kernel ahead of it still runs; the
    values are right once the stream passed it; ``close()`` with such work queued returns."""
    ex = _exchange(dev)
    inp = torch.arange(1 << 20, dtype=torch.float32, device=dev)
    out = torch.empty_like(inp)
    if DRY:  # gloo on host tensors: the wait and close run, nothing is queued to overtake
        ex.all_to_all_async(out, inp, [], [], round=0, op="all_to_all(gpu check)").wait()
        check(torch.equal(out, inp), "world-1 all_to_all changed the values")
        t0 = time.perf_counter()
        ex.close()
        ok("c.wait", f"wait and close on gloo ({time.perf_counter() - t0:.3f} s); "
           "the device-side wait is not checked on a CPU")  # fmt: skip
        return
    rate = sleep_rate(dev)  # CUDA only from here
    stream = torch.cuda.current_stream(dev)
    ex.all_to_all_async(out, inp, [], [], round=0, op="all_to_all(warm-up)").wait()
    stream.synchronize()  # the communicator and its buffers exist: only the wait is timed
    slept = gpu_sleep(SLEEP_S, rate, dev)
    t0 = time.perf_counter()
    ex.all_to_all_async(out, inp, [], [], round=1, op="all_to_all(gpu check)").wait()
    waited = time.perf_counter() - t0
    running = not slept.query()
    problems = []  # both halves run, then both verdicts
    if not (running and waited <= WAIT_S):
        problems.append(
            f"Exchange.all_to_all_async(...).wait() on NCCL took {waited:.3f} s on the host "
            f"with a {SLEEP_S:.1f} s kernel queued ahead (kernel still running after it: "
            f"{running}): the wait blocks the host instead of ordering the stream on the device"
        )
    stream.synchronize()
    if not torch.equal(out, inp):
        problems.append("world-1 NCCL all_to_all changed the values")
    # close with work queued: a kernel, then an all-to-all behind it, waited on the device
    slept = gpu_sleep(SLEEP_S, rate, dev)
    ex.all_to_all_async(out, inp, [], [], round=2, op="all_to_all(gpu check)").wait()
    queued = not slept.query()
    closer = threading.Thread(target=ex.close, name="gpu-check-close", daemon=True)
    t1 = time.perf_counter()
    closer.start()
    closer.join(SLEEP_S + CLOSE_S)
    closed = time.perf_counter() - t1
    if closer.is_alive():  # stuck in NCCL: nothing after this would return either
        problems.append(f"Exchange.close() with NCCL work queued: no return in {closed:.0f} s")
        print("c.wait FAILED: " + "; ".join(problems), file=sys.stderr, flush=True)
        os._exit(3)
    stream.synchronize()
    check(not problems, "; ".join(problems) + f" (close() returned in {closed:.2f} s)")
    ok(
        "c.wait",
        f"NCCL all-to-all waited on the device: the host went on after {waited * 1e3:.1f} ms "
        f"with a {SLEEP_S:.0f} s kernel still ahead of it; close() with such work queued "
        f"(kernel running at close: {queued}) returned in {closed:.2f} s",
        wait_ms=waited * 1e3,
        close_s=closed,
    )


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
        device_wait(dev)
    finally:
        cd.destroy_distributed()


if __name__ == "__main__":
    main()
