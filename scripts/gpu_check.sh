#!/usr/bin/env bash
# GPU check: exercises the CUDA paths on one GPU and prints one line per check, a JSON line last;
# exits non-zero on the first failure. Run it whenever a GPU is available:
#   bash scripts/gpu_check.sh
# 1. device tier, pinned host staging and its H2D copy; 2. device staging: items put from GPU
# tensors are staged and packed in device memory (no host round trip), both paths timed;
# 3. side-stream overlap gives the batches of sync; 4. pooled-buffer reuse race: a slow consumer
# kernel still reading a batch while the next rounds write pooled buffers (the round's stream
# must wait for it); 5. a pinned host tier.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --disable-pip-version-check -e . >/dev/null 2>&1 || true
python - <<'PY'
import json, time
import torch
import conduit_dist as cd

assert torch.cuda.is_available(), "no CUDA device"
out = {"device": torch.cuda.get_device_name(0)}
cd.init_distributed(device="cuda")
dev = torch.device("cuda")
batch = {
    "obs": torch.randint(0, 256, (512, 4, 84, 84), dtype=torch.uint8),
    "reward": torch.randn(512),
    "id": torch.arange(512),
}
spec = cd.ExperienceSpec.from_batch(batch)


def median_ms(fn, reps=30):
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return sorted(ts)[len(ts) // 2]


# 1. device tier + pinned host staging + H2D. One CUDA rank over one tier writes puts straight
# into the shard (no staging at all); two tiers make puts go through staging, as at world > 1.
tiers = cd.Tiers([("device", 2048), ("host", 2048)])
plane = cd.DataPlane(spec, 4096, seed=0, device="cuda", schedule="sync", storage=tiers)
stager = plane._p.stager
assert plane.shard.rings[0].tier.kind == "device" and plane.shard.rings[0].tier.data.is_cuda
assert stager.buffers.current.data.is_pinned(), "host staging is not pinned"
plane.put(batch)
b = plane.fetch(256)
assert b["obs"].is_cuda and torch.equal(b["obs"].cpu(), batch["obs"][b["id"].cpu()])
print("device tier + pinned staging + H2D: ok")

# 2. device staging follows the data: GPU tensors are packed in device memory
gpu_batch = {k: v.to(dev) for k, v in batch.items()}
gpu_batch["id"] = gpu_batch["id"] + 10_000
plane.put(gpu_batch)
assert stager.device_buffers.current.count == 512 and stager.buffers.current.count == 0
b = plane.fetch(512)
fresh = b["id"] >= 10_000
assert fresh.any(), "device-staged items never arrived"
ids = b["id"][fresh] - 10_000
assert torch.equal(b["obs"][fresh], gpu_batch["obs"][ids]), "device-staged items corrupted"
host_ms = median_ms(lambda: (plane.put(batch), plane.flush()))
device_ms = median_ms(lambda: (plane.put(gpu_batch), plane.flush()))
print(f"device staging: ok (put+round of 512 Atari-like items: from host {host_ms:.3f} ms, "
      f"from GPU {device_ms:.3f} ms)")
out.update(put_round_from_host_ms=host_ms, put_round_from_gpu_ms=device_ms)
plane.close()

# 3. overlap: rounds on a side stream, consumer waits on an event; batches equal sync's
model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4 * 84 * 84, 256), torch.nn.ReLU(),
                            torch.nn.Linear(256, 1)).cuda()
res = {}
for schedule in ("sync", "overlap"):
    plane = cd.DataPlane(spec, 8192, seed=1, device="cuda", schedule=schedule)
    plane.attach(model)
    ids, exposed, t0 = [], [], time.perf_counter()
    for it in range(30):
        if schedule == "overlap" or it == 0:
            plane.put(batch)
        b = plane.fetch(256)
        ids.append(b["id"].cpu())
        exposed.append(plane.last_fetch.exposed_ms)
        model(b["obs"].float()).sum().backward()
        if schedule == "sync" and it > 0:
            plane.put(batch)
    torch.cuda.synchronize()
    res[schedule] = (torch.cat(ids), sorted(exposed)[len(exposed) // 2], time.perf_counter() - t0)
    plane.close()
assert torch.equal(res["sync"][0], res["overlap"][0]), "overlap batches differ from sync"
print(f"side-stream overlap: ok (median exposed sync {res['sync'][1]:.3f} ms, "
      f"overlap {res['overlap'][1]:.3f} ms)")
out.update(exposed_sync_ms=res["sync"][1], exposed_overlap_ms=res["overlap"][1])

# 4. reuse race: a consumer kernel queued behind a long one still reads batch k after the
# caller dropped it; the next rounds reuse its pooled buffer on the side stream. Without the
# side stream waiting for the consumer stream, the reduction would read rows of a later batch.
plane = cd.DataPlane(spec, 8192, seed=2, device="cuda", schedule="overlap")
model.zero_grad()
plane.attach(model)
plane.put(batch)
big = torch.randn(8192, 8192, device=dev)
mismatch = 0
for it in range(20):
    b = plane.fetch(256)
    expect = b["id"].sum().item()  # synchronises: the batch is complete here
    for _ in range(4):
        big = big @ big * 1e-4  # ~ms of work queued on the consumer stream ahead of the read
    got = b["id"].sum()  # queued behind the matmuls, reading the pooled buffer
    keep = b["obs"][:1].float().clone()
    del b  # the pooled buffer is free for the next round while `got` is still queued
    plane.put(batch)
    model(keep).sum().backward()  # launches the next round: it writes a free pooled buffer
    mismatch += int(got.item() != expect)
plane.close()
assert mismatch == 0, f"{mismatch}/20 batches were overwritten while a consumer kernel read them"
print("pooled-buffer reuse waits for the consumer stream: ok")

# 5. pinned host tier
from conduit_dist.tiers import MemoryTier
tier = MemoryTier(128, spec.record_bytes, "cpu", pin_memory=True)
assert tier.data.is_pinned() and tier.kind == "pinned"
print("pinned tier: ok")
cd.destroy_distributed()
print(json.dumps({"gpu_check": "ok", **out}))
PY
