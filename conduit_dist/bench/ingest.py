"""``torchrun --standalone --nproc_per_node=2 -m conduit_dist.bench ingest``: ingestion goodput.

Side by side in one run, per message size ``S`` per peer (64 KiB .. 64 MiB): every rank ``put``s
``world * S`` bytes of experience (records of a 4 KB uint8 observation, an int64 action and a
float32 reward) and runs a round with ``round_robin`` placement, which sends ``S`` to each peer and
keeps ``S``; the baseline is one raw ``all_to_all_single`` of the same bytes from a ready buffer.
``put`` is measured copying (the default: the batch is packed into staging before ``put``
returns), donating (``put(batch, donate=True)``: packed by the round, while its meta exchange is
in flight), and written in place (``plane.staged(n)``: the producer's writes into the staging rows
are not timed, as the raw baseline's buffer is ready too; the round alone is). Goodput =
experience bytes ingested per rank per second. All are timed interleaved, call by call (each
rank's slowest, medians over repeats); the JSON line's ``summary`` has ``min_vs_raw_from_1MiB``
(copying ``put``), ``min_vs_raw_from_1MiB_donated`` and ``min_vs_raw_from_1MiB_staged``.
``--shared-memory`` runs the plane over ``/dev/shm`` (``TransportConfig(shared_memory=True)``)
against the same gloo baseline: a different transport, so a favourable setting, not a like for
like one.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import conduit_dist as cd
from conduit_dist.bench.common import emit, number

KIB = 1024


def _batch(n: int) -> dict[str, torch.Tensor]:
    return {
        "obs": torch.randint(0, 256, (n, 4000), dtype=torch.uint8),
        "action": torch.randint(0, 6, (n,)),
        "reward": torch.randn(n),
    }


def _timed(fns: dict[str, tuple], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds per timed call of each ``(setup, fn)``, called in turn (A B C A B C ...).

    ``setup`` (or ``None``) runs untimed before each timed ``fn``.
    """
    for _ in range(warmup):
        for setup, fn in fns.values():
            if setup is not None:
                setup()
            fn()
    samples = {k: [] for k in fns}
    for _ in range(repeats):
        for key, (setup, fn) in fns.items():
            if setup is not None:
                setup()
            dist.barrier()
            start = time.perf_counter()
            fn()
            samples[key].append(time.perf_counter() - start)
    out = {}
    for key, v in samples.items():
        t = torch.tensor(v, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a round ends when its slowest rank ends
        out[key] = statistics.median(t.tolist())
    return out


def main(argv: list[str]) -> None:
    """Run the ingest benchmark (every rank) and print the JSON line last on rank 0."""
    p = argparse.ArgumentParser(prog="python -m conduit_dist.bench ingest")
    p.add_argument(
        "--sizes-kib", nargs="+", type=number(int, 1), default=[64, 256, 1024, 4096, 16384, 65536]
    )
    p.add_argument("--repeats", type=number(int, 1), default=15)
    p.add_argument("--shared-memory", action="store_true",
                   help="the plane moves host rows through /dev/shm (TransportConfig(shared_"
                        "memory=True)); the raw baseline stays gloo's all-to-all")  # fmt: skip
    a = p.parse_args(argv)
    cd.init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    spec = cd.ExperienceSpec.from_batch(_batch(1))
    rows = []
    for kib in a.sizes_kib:
        per_peer = max(1, kib * KIB // spec.record_bytes)
        n = per_peer * world
        nbytes = n * spec.record_bytes
        batch = _batch(n)
        plane = cd.DataPlane(
            spec, capacity_per_rank=4 * n, seed=0, placement="round_robin", schedule="sync",
            transport=cd.TransportConfig(shared_memory=a.shared_memory),
        )  # fmt: skip

        def copying(plane=plane, batch=batch):
            plane.put(batch)
            plane.flush()

        def donating(plane=plane, batch=batch):
            plane.put(batch, donate=True)
            plane.flush()

        def produce(plane=plane, batch=batch, n=n):  # untimed: a producer writing in place
            with plane.staged(n) as rows:
                for k, v in batch.items():
                    rows[k].copy_(v)

        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        dst = torch.empty_like(src)
        t = _timed(
            {
                "copy": (None, copying),
                "donate": (None, donating),
                "staged": (produce, plane.flush),
                "raw": (None, lambda src=src, dst=dst: dist.all_to_all_single(dst, src)),
            },
            a.repeats,
            warmup=3,  # wraps the ring once: memory touched
        )
        plane.close()
        rows.append(
            {
                "per_peer_kib": per_peer * spec.record_bytes / KIB,
                "conduit_gbps": nbytes / t["copy"] / 1e9,
                "donated_gbps": nbytes / t["donate"] / 1e9,
                "raw_gbps": nbytes / t["raw"] / 1e9,
                "ratio": t["raw"] / t["copy"],
                "ratio_donated": t["raw"] / t["donate"],
                "ratio_staged": t["raw"] / t["staged"],
                "staged_ms": t["staged"] * 1e3,
                "conduit_ms": t["copy"] * 1e3,
                "donated_ms": t["donate"] * 1e3,
                "raw_ms": t["raw"] * 1e3,
            }
        )
        if rank == 0:
            r = rows[-1]
            print(
                f"{kib:>6} KiB/peer  put {r['conduit_ms']:.2f} ms  put(donate) "
                f"{r['donated_ms']:.2f} ms  raw {r['raw_ms']:.2f} ms ({r['raw_gbps']:.2f} GB/s)"
                f"  ratio {r['ratio']:.2f} / donated {r['ratio_donated']:.2f}"
                f" / staged {r['ratio_staged']:.2f} ({r['staged_ms']:.2f} ms)",
                flush=True,
            )
    big = [r for r in rows if r["per_peer_kib"] >= 1000]
    if rank == 0:
        summary = {
            "min_vs_raw_from_1MiB": min(r["ratio"] for r in big) if big else None,
            "min_vs_raw_from_1MiB_donated": min(r["ratio_donated"] for r in big) if big else None,
            "min_vs_raw_from_1MiB_staged": min(r["ratio_staged"] for r in big) if big else None,
        }
        emit("ingest", rows, summary, world=world, backend=dist.get_backend(),
             shared_memory=a.shared_memory)  # fmt: skip
    cd.destroy_distributed()


if __name__ == "__main__":
    main(__import__("sys").argv[1:])
