"""Step (a) of the GPU check, one process: the device paths at world size 1.

Device tier over a host tier past overflow (demotion, eviction), pinned host staging and its
host-to-device copy, puts from GPU tensors (staged and donated), fetches delivered on the device
and checked row by row against what was put; one host read per GPU put (NaN check) and per fetch
(age check); side-stream rounds (``overlap``) giving sync's batches; pooled batch buffers not
reused while a consumer kernel still reads them; the CUDA allocator's counts of an overlapped
plane the same after round 50 and after round 300.

    python scripts/gpu_check/world1.py
"""

from __future__ import annotations

import torch
from common import (
    DEVICE,
    DRY,
    Reads,
    check,
    items,
    median_ms,
    memory,
    memory_flat,
    ok,
    sync,
    tier,
    verify,
)

import conduit_dist as cd
from conduit_dist.flow.versions import check_ages


def tiers_and_staging(spec: cd.ExperienceSpec) -> None:
    """Device and host tiers past overflow, pinned staging, GPU puts, host reads."""
    tiers = cd.Tiers([(tier("device"), 1024), ("host", 1024)])
    plane = cd.DataPlane(spec, 2048, seed=0, device=DEVICE, schedule="sync", storage=tiers)
    dev = plane.device
    first = plane.shard.tiers[0]
    check(first.kind == tier("device") and first.data.device == dev, f"first tier {first.kind}")
    if not DRY:
        check(dev.type == "cuda" and dev.index is not None, f"plane device {dev}: not cuda:<i>")
        check(plane._p.stager.buffers.current.data.is_pinned(), "host staging is not pinned")
    rows, at = 0, 0
    for _ in range(6):  # 3072 items over 2048 slots: demotion to the host tier, then eviction
        plane.put(items(torch.arange(at, at + 512)))
        at += 512
        rows += verify(plane.fetch(256), dev)
    stats = plane.store_stats()
    check(stats["demotions"] > 0 and stats["evictions"] > 0, f"no overflow: {stats}")
    ok("a.tiers", f"device+host tiers past overflow, pinned staging, {rows} rows checked on {dev}")

    gpu = items(torch.arange(100_000, 100_512), dev)
    plane.put(gpu)
    b = plane.fetch(512)
    verify(b, dev)
    check(bool((b["id"] >= 100_000).any()), "items put from GPU tensors never arrived")
    donated = items(torch.arange(200_000, 200_512), dev)
    plane.put(donated, donate=True)  # packed by the round: left alone until it completed
    b = plane.fetch(512)
    verify(b, dev)
    check(bool((b["id"] >= 200_000).any()), "donated GPU items never arrived")
    host = items(torch.arange(300_000, 300_512))
    host_ms = median_ms(lambda: (plane.put(host), plane.flush()))
    gpu_ms = median_ms(lambda: (plane.put(gpu), plane.flush()))
    ok(
        "a.gpu_puts",
        f"puts from GPU tensors (staged, donated) delivered intact; put+round of 512 items "
        f"from host {host_ms:.3f} ms, from GPU {gpu_ms:.3f} ms",
        put_round_host_ms=host_ms,
        put_round_gpu_ms=gpu_ms,
    )

    if not DRY:  # on the CPU the C extension scans in place: no torch read to count
        with Reads() as r:  # reward, value, adv: three float fields
            spec.check_finite(gpu)
        check(len(r.reads) == 1, f"NaN check of a GPU put read the host {len(r.reads)} times")
    with Reads() as r:
        check_ages(b["_version"], newest=5, max_age=5, rank=0, round=0)  # vacuous: no read
        check_ages(b["_version"] + 5, newest=5, max_age=1, rank=0, round=0)
    check(len(r.reads) == 1, f"age check read the host {len(r.reads)} times, expected 1")
    plane.close()
    ok("a.host_reads", "NaN check: 1 host read per GPU put (3 float fields); age check: 1/fetch")


def overlap_matches_sync(spec: cd.ExperienceSpec) -> None:
    """Rounds on the side stream, launched at backward, deliver sync's batches."""
    model = torch.nn.Linear(spec.fields["obs"].numel, 1).to(DEVICE)
    got = {}
    for schedule in ("sync", "overlap"):
        plane = cd.DataPlane(spec, 8192, seed=1, device=DEVICE, schedule=schedule)
        plane.attach(model)
        ahead = plane.chosen_schedule == "overlap"  # (one CPU rank runs rounds inline)
        check(DRY or ahead == (schedule == "overlap"), f"{schedule}: ran {plane.chosen_schedule}")
        ids = []
        for it in range(20):
            # each round takes the same puts: a launched round misses the puts made after it
            if ahead or it == 0:
                plane.put(items(torch.arange(512) + 512 * it))
            b = plane.fetch(256)
            verify(b, plane.device)
            ids.append(b["id"].to("cpu", copy=True))  # a copy: the batch is a pooled view
            model(b["obs"].flatten(1).float()).sum().backward()
            if not ahead and it > 0:
                plane.put(items(torch.arange(512) + 512 * it))
        got[schedule] = torch.cat(ids)
        plane.close()
    check(torch.equal(got["sync"], got["overlap"]), "overlap's batches differ from sync's")
    ok("a.overlap", "side-stream rounds deliver sync's batches (20 fetches)")


def reuse_waits_for_the_consumer(spec: cd.ExperienceSpec) -> None:
    """A consumer kernel queued behind a long one still reads batch k after the caller dropped
    it; the next rounds reuse its pooled buffer on the side stream, which must wait."""
    plane = cd.DataPlane(spec, 8192, seed=2, device=DEVICE, schedule="overlap")
    model = torch.nn.Linear(spec.fields["obs"].numel, 1).to(DEVICE)
    plane.attach(model)
    plane.put(items(torch.arange(4096)))
    big = torch.randn(4096, 4096, device=plane.device)
    mismatch = 0
    for _ in range(20):
        b = plane.fetch(256)
        expect = int(b["id"].sum())  # synchronises: the batch is complete here
        for _ in range(4):
            big = big @ big * 1e-4  # work queued on the consumer stream ahead of the read
        got = b["id"].sum()  # queued behind it, reading the pooled buffer
        keep = b["obs"][:1].flatten(1).float().clone()
        del b  # the pooled buffer is free for the next round while `got` is still queued
        plane.put(items(torch.arange(4096)))
        model(keep).sum().backward()  # launches the next round, which writes a pooled buffer
        mismatch += int(int(got) != expect)
    plane.close()
    check(mismatch == 0, f"{mismatch}/20 batches overwritten while a consumer kernel read them")
    ok("a.reuse", "pooled batch buffers wait for the consumer stream")


def _allocs_per_round(spec: cd.ExperienceSpec, schedule: str) -> float:
    """CUDA caching-allocator requests per round (a put from the host, its fetch, a Linear's
    forward and backward) over 100 rounds after 20 of warm-up."""
    plane = cd.DataPlane(spec, 8192, seed=3, device=DEVICE, schedule=schedule)
    model = torch.nn.Linear(spec.fields["obs"].numel, 1).to(DEVICE)
    plane.attach(model)
    batch = items(torch.arange(256))
    counts = []
    for n in (20, 100):
        plane.wait()  # overlap: the round launched at the last backward has finished
        sync()
        counts.append(torch.cuda.memory_stats(plane.device)["allocation.all.allocated"])
        for _ in range(n):
            plane.put(batch)
            b = plane.fetch(256)
            model(b["obs"].flatten(1).float()).sum().backward()
    plane.wait()
    sync()
    after = torch.cuda.memory_stats(plane.device)["allocation.all.allocated"]
    plane.close()
    return (after - counts[1]) / 100


def allocations(spec: cd.ExperienceSpec) -> None:
    """The GPU side of ``bench rounds``' allocation count, for each schedule (the model's own
    gradients and activations included: a baseline for the plane's share)."""
    per_round = {s: _allocs_per_round(spec, s) for s in ("sync", "overlap")}
    model = torch.nn.Linear(spec.fields["obs"].numel, 1).to(DEVICE)
    obs = items(torch.arange(256), DEVICE)["obs"]
    dev = obs.device
    sync()
    before = torch.cuda.memory_stats(dev)["allocation.all.allocated"]
    for _ in range(100):
        model(obs.flatten(1).float()).sum().backward()
    sync()
    after = torch.cuda.memory_stats(dev)["allocation.all.allocated"]
    per_round["model alone"] = (after - before) / 100
    alone = per_round["model alone"]
    for k in ("sync", "overlap"):  # the plane's own share: no allocation per round
        check(per_round[k] <= alone + 0.05, f"{k}: {per_round[k]:.2f} requests a round, "
              f"the model alone {alone:.2f}")  # fmt: skip
    ok(
        "a.allocs",
        "CUDA allocator requests per round (put + fetch + a Linear's forward/backward): "
        + ", ".join(f"{k} {v:.2f}" for k, v in per_round.items()),
        **{f"allocs_per_round_{k.replace(' ', '_')}": v for k, v in per_round.items()},
    )


MEMORY_ROUNDS = (50, 300)  # the allocator's counts compared after these rounds


def memory_over_rounds(spec: cd.ExperienceSpec) -> None:
    """An overlapped plane (rounds on the round thread's side stream) with puts and fetches of
    one size, a Linear attached: allocated and reserved bytes after round 50 and 300 agree
    within ``common.ALLOCATED_SLACK`` / ``RESERVED_SLACK``."""
    plane = cd.DataPlane(spec, 4096, seed=4, device=DEVICE, schedule="overlap")
    model = torch.nn.Linear(spec.fields["obs"].numel, 1).to(plane.device)
    plane.attach(model)
    marks = {}
    for it in range(1, MEMORY_ROUNDS[1] + 1):
        plane.put(items(torch.arange(256) + 256 * it))
        b = plane.fetch(256)
        model(b["obs"].flatten(1).float()).sum().backward()
        if it in MEMORY_ROUNDS:
            plane.wait()  # the round launched at this backward has finished
            marks[it] = memory(plane.device)
    plane.close()
    if DRY:
        ok("a.memory", f"overlapped plane ran {MEMORY_ROUNDS[1]} rounds (no CUDA memory)")
        return
    got = memory_flat(marks[MEMORY_ROUNDS[0]], marks[MEMORY_ROUNDS[1]], "world size 1")
    ok(
        "a.memory",
        f"world size 1, overlapped: allocated {got['allocated_early']} -> "
        f"{got['allocated_late']} B, reserved {got['reserved_early']} -> {got['reserved_late']} B "
        f"between rounds {MEMORY_ROUNDS[0]} and {MEMORY_ROUNDS[1]}",
        **got,
    )


def main() -> None:
    """Run step (a)."""
    check(DRY or torch.cuda.is_available(), "no CUDA device visible")
    cd.init_distributed(device=DEVICE)
    try:
        spec = cd.ExperienceSpec.from_batch(items(torch.arange(1)))
        tiers_and_staging(spec)
        overlap_matches_sync(spec)
        memory_over_rounds(spec)
        if not DRY:  # a race between CUDA streams: nothing to race on the CPU
            reuse_waits_for_the_consumer(spec)
            allocations(spec)
    finally:
        cd.destroy_distributed()


if __name__ == "__main__":
    main()
