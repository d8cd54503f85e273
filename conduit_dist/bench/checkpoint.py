"""``torchrun --standalone --nproc_per_node=2 -m conduit_dist.bench checkpoint``: what a
checkpoint of a full store costs the rounds while it is written, against the ways peers take one.

Every rank fills its shard (``--gib`` of 1 KiB records, default 1 GiB), then runs rounds
(``put`` + ``fetch`` of ``--batch`` items, ``sync``, local placement) in windows of the same
number of rounds, sized to last about as long as the ``--mbps``-limited write. Each mode's
window follows a baseline window with no checkpoint (so drift on a shared machine cancels in
each pair), ``--repeats`` times:

- ``ours``: ``plane.checkpoint(root)`` at the window's start (the defaults): a copy-on-write
  snapshot, the items written on a thread as fast as the disk takes them (``O_DIRECT``), then
  checksummed reading them back, with no rate limit (the writer takes what CPU it can);
- ``ours_checksum_limited``: the checksum pass held to ``--mbps`` (spreading its CPU; measured
  to cost the rounds more in total, not less);
- ``ours_slow_write`` (not by default): the items held to 32 MB/s (``write_mbps``): the rounds
  overwrite faster than the writer reads, so they copy the blocks it has not reached
  (copy-on-write at work; the window ends before its write does);
- ``dcp_async``: ``torch.distributed.checkpoint.async_save`` of the shard's tier (its own gloo
  group): its default stager copies the tier first, in the caller, then writes on a thread;
- ``stop_world``: ``torch.save(plane.state_dict())`` and fsync inside the window (rounds stop).

Per window: its wall time, the writer's time (did the write fit the window), the caller's
blocking time and copy-on-write bytes. ``cost`` = 1 - baseline time / window time for the pair
(the rounds' throughput lost over a window as long as our write); ``lost_s`` = window time -
baseline time (the same in seconds, independent of the window's length). The slowest rank's
time per window; medians over repeats. JSON line last.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import conduit_dist as cd
from conduit_dist.bench.common import emit, number

MODES = ("ours", "ours_checksum_limited", "ours_slow_write", "dcp_async", "stop_world")
DEFAULT_MODES = ("ours", "ours_checksum_limited", "dcp_async", "stop_world")
SLOW_WRITE_MBPS = 32.0
RECORD = 1024  # bytes a stored record (1008 + id + _version)


def _spec() -> cd.ExperienceSpec:
    return cd.ExperienceSpec({"obs": ((1008,), torch.uint8), "id": ((), torch.int64)})


def _batch(n: int, start: int) -> dict[str, torch.Tensor]:
    obs = torch.arange(1008, dtype=torch.uint8).expand(n, 1008).contiguous()
    return {"obs": obs, "id": torch.arange(start, start + n)}


def _rounds(plane, batch, n: int) -> list[float]:
    done = []
    for _ in range(n):
        plane.put(batch)
        plane.fetch(batch["id"].numel())
        done.append(time.perf_counter())
    return done


def _window(plane, batch, n: int, mode: str, root: str, args, pg) -> dict[str, float]:
    dist.barrier()
    t0 = time.perf_counter()
    ck = fut = None
    if mode.startswith("ours"):
        write = SLOW_WRITE_MBPS if mode == "ours_slow_write" else 0.0
        check = args.mbps if mode == "ours_checksum_limited" else 0.0
        ck = plane.checkpoint(root, write_mbps=write, checksum_mbps=check, keep=1)
    elif mode == "dcp_async":
        import torch.distributed.checkpoint as dcp

        data = plane.shard.tier.data
        fut = dcp.async_save({f"shard{plane.rank}": data}, checkpoint_id=root, process_group=pg)
    elif mode == "stop_world":
        path = os.path.join(root, f"state{plane.rank}.pt")
        os.makedirs(root, exist_ok=True)
        with open(path, "wb") as f:
            torch.save(plane.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())
    blocked = time.perf_counter() - t0
    done = _rounds(plane, batch, n)
    wall = time.perf_counter() - t0
    write_s, copied = 0.0, 0
    if ck is not None:
        ck.wait(600)
        write_s, copied = ck.write_s, ck.copied_bytes
    elif fut is not None:
        fut.result()
        write_s = time.perf_counter() - t0
    elif mode == "stop_world":
        write_s = blocked
    dist.barrier()
    shutil.rmtree(root, ignore_errors=True)
    end = t0 + min(write_s, wall)  # rounds/s while the write ran, and after it
    during = sum(1 for t in done if t <= end) / max(end - t0, 1e-9)
    after = sum(1 for t in done if t > end) / max(wall - (end - t0), 1e-9)
    return {
        "wall_s": wall, "blocked_s": blocked, "write_s": write_s, "copied_bytes": copied,
        "rate_during": during if write_s else 0.0, "rate_after": after,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark (under torchrun with 2 ranks); print the JSON line last."""
    p = argparse.ArgumentParser(prog="python -m conduit_dist.bench checkpoint")
    p.add_argument("--gib", type=number(float, 0, strict=True), default=1.0)
    p.add_argument("--batch", type=number(int, 1), default=256)
    p.add_argument("--mbps", type=number(float, 0, strict=True), default=64.0)
    p.add_argument("--repeats", type=number(int, 1), default=3)
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary dir)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(DEFAULT_MODES))
    a = p.parse_args(argv)
    cd.init_distributed(timeout_s=600)
    rank = dist.get_rank()
    pg = dist.new_group(backend="gloo")  # DCP's planning collectives, apart from the plane's
    cap = int(a.gib * (1 << 30)) // RECORD
    plane = cd.DataPlane(
        _spec(),
        cap,
        seed=0,
        placement="local",
        schedule="sync",
        transport=cd.TransportConfig(timeout_s=600),
    )
    port = os.environ.get("MASTER_PORT", "0")  # one directory for all ranks (one host)
    base = (
        os.path.join(tempfile.gettempdir(), f"conduit-ckbench-{port}") if a.dir is None else a.dir
    )
    try:
        t0 = time.perf_counter()
        fill = 16384
        for start in range(0, cap, fill):
            plane.put(_batch(min(fill, cap - start), start + rank * cap))
            plane.flush()
        plane.wait()
        fill_s = time.perf_counter() - t0
        batch = _batch(a.batch, 0)
        _rounds(plane, batch, 50)  # warm
        probe = _window(plane, batch, 200, "none", "", a, pg)
        rate = 200 / probe["wall_s"]
        # a window lasts about as long as our default write (items at ~disk speed, then the
        # checksum pass at --mbps)
        longest = a.gib * (1 << 30) / (a.mbps * 1e6) + 6.0 * a.gib  # ~6 s a GiB: items out
        n_t = torch.tensor([max(200, int(rate * longest * 1.2))])
        dist.broadcast(n_t, 0)  # every rank runs the same rounds
        n = int(n_t)
        runs: dict[str, list[dict]] = {m: [] for m in a.modes}
        pairs: dict[str, list[float]] = {m: [] for m in a.modes}  # baseline wall just before
        for rep in range(a.repeats):
            for mode in a.modes:
                base_w = _window(plane, batch, n, "none", "", a, pg)  # the drift-free baseline
                root = os.path.join(base, f"{mode}{rep}")
                runs[mode].append(_window(plane, batch, n, mode, root, a, pg))
                pairs[mode].append(base_w["wall_s"])
        results = []
        for mode, ws in runs.items():
            walls = torch.tensor([[w["wall_s"] for w in ws], pairs[mode]], dtype=torch.float64)
            gathered = [torch.zeros_like(walls) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, walls)
            worst = torch.stack(gathered).max(dim=0).values  # the slowest rank, per window
            costs = (1 - worst[1] / worst[0]).tolist()
            lost = (worst[0] - worst[1]).tolist()
            results.append(
                {
                    "mode": mode,
                    "rounds": n,
                    "wall_s": statistics.median(worst[0].tolist()),
                    "baseline_wall_s": statistics.median(worst[1].tolist()),
                    "cost": statistics.median(costs),
                    "costs": [round(c, 4) for c in costs],
                    "lost_s": statistics.median(lost),
                    "write_s": statistics.median(w["write_s"] for w in ws),
                    "blocked_s": statistics.median(w["blocked_s"] for w in ws),
                    "copied_mb": statistics.median(w["copied_bytes"] for w in ws) / 1e6,
                    "rounds_per_s_during_write": statistics.median(w["rate_during"] for w in ws),
                    "rounds_per_s_after_write": statistics.median(w["rate_after"] for w in ws),
                }
            )
        summary = {"fill_s": fill_s, "gib_per_shard": a.gib, "checksum_mbps": a.mbps}
        for r in results:
            summary[f"{r['mode']}_cost"] = round(r["cost"], 4)
            summary[f"{r['mode']}_lost_s"] = round(r["lost_s"], 3)
        if rank == 0:
            emit("checkpoint", results, summary, world=dist.get_world_size())
    finally:
        plane.close()
        if a.dir is None:
            shutil.rmtree(base, ignore_errors=True)
        cd.destroy_distributed()


if __name__ == "__main__":
    main()
