#!/usr/bin/env bash
# GPU check: exercises the CUDA paths (device tier, pinned staging, side-stream rounds with events,
# the H2D path) on one GPU. Run it whenever a GPU is available:
#   bash scripts/gpu_check.sh
# Prints one line per check and a JSON line last; exits non-zero on the first failure.
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
batch = {
    "obs": torch.randint(0, 256, (512, 4, 84, 84), dtype=torch.uint8),
    "reward": torch.randn(512),
    "id": torch.arange(512),
}
spec = cd.ExperienceSpec.from_batch(batch)

# 1. device tier: the shard lives in GPU memory, fetched batches arrive on the GPU
plane = cd.DataPlane(spec, 4096, seed=0, device="cuda", schedule="sync")
assert plane.shard.tier.kind == "device" and plane.shard.tier.data.is_cuda
assert plane._stage.current.data.is_pinned(), "staging is not pinned host memory"
plane.put(batch)
b = plane.fetch(256)
assert b["obs"].is_cuda and torch.equal(b["obs"].cpu(), batch["obs"][b["id"].cpu()])
print("device tier + pinned staging + H2D: ok")
plane.close()

# 2. overlap: rounds on a side stream, consumer waits on an event; batches equal sync's
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

# 3. pinned host tier
from conduit_dist.tiers import MemoryTier
tier = MemoryTier(128, spec.record_bytes, "cpu", pin_memory=True)
assert tier.data.is_pinned() and tier.kind == "pinned"
print("pinned tier: ok")
cd.destroy_distributed()
print(json.dumps({"gpu_check": "ok", **out}))
PY
