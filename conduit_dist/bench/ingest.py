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
rank's slowest, medians over repeats).

Two planes side by side (``--transports``): ``gloo`` (``shared_memory=False``, the neutral
setting: the same transport as the raw baseline) and ``shm`` (``shared_memory=True``, what
``auto`` picks for ranks of one host: a favourable setting against gloo, so the raw call is
also replayed through a shared-memory exchange of its own, ``raw_shm_ms``). Every ratio
(``<transport>_<copy|donate|staged>_vs_raw``) is against gloo's raw all-to-all; the JSON
line's ``summary`` has each one's minimum from 1 MiB per peer
(``<transport>_<how>_min_vs_raw_from_1MiB``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import conduit_dist as cd
from conduit_dist.bench.common import emit, number
from conduit_dist.collectives.exchange import Exchange

KIB = 1024
TRANSPORTS = ("gloo", "shm")
HOWS = ("copy", "donate", "staged")


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
    p.add_argument("--transports", nargs="+", choices=TRANSPORTS, default=list(TRANSPORTS),
                   help="the planes timed: gloo (shared_memory=False), shm (True); the raw "
                        "baselines are gloo's all-to-all and, with shm, a shared-memory "
                        "exchange's")  # fmt: skip
    a = p.parse_args(argv)
    cd.init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    spec = cd.ExperienceSpec.from_batch(_batch(1))
    raw_ex = Exchange(60.0, name="bench-raw", shared_memory="shm" in a.transports)
    rows = []
    for kib in a.sizes_kib:
        per_peer = max(1, kib * KIB // spec.record_bytes)
        n = per_peer * world
        nbytes = n * spec.record_bytes
        batch = _batch(n)
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        dst = torch.empty_like(src)
        fns = {"raw": (None, lambda src=src, dst=dst: dist.all_to_all_single(dst, src))}
        if raw_ex.shm is not None:
            fns["raw_shm"] = (
                None,
                lambda src=src, dst=dst, shm=raw_ex.shm: shm.start(dst, src, [], []).wait(),
            )
        planes = {}
        for kind in a.transports:
            plane = planes[kind] = cd.DataPlane(
                spec, capacity_per_rank=4 * n, seed=0, placement="round_robin", schedule="sync",
                transport=cd.TransportConfig(shared_memory=kind == "shm"),
            )  # fmt: skip
            fns.update(_plane_fns(kind, plane, batch, n))
        t = _timed(fns, a.repeats, warmup=3)  # warm-up wraps the ring once: memory touched
        for plane in planes.values():
            plane.close()
        row = {"per_peer_kib": per_peer * spec.record_bytes / KIB, "raw_ms": t["raw"] * 1e3}
        row["raw_gbps"] = nbytes / t["raw"] / 1e9
        if "raw_shm" in t:
            row["raw_shm_ms"] = t["raw_shm"] * 1e3
        for kind in a.transports:
            for how in HOWS:
                row[f"{kind}_{how}_ms"] = t[f"{kind}:{how}"] * 1e3
                row[f"{kind}_{how}_vs_raw"] = t["raw"] / t[f"{kind}:{how}"]
        rows.append(row)
        if rank == 0:
            _print(kib, row, a.transports)
    big = [r for r in rows if r["per_peer_kib"] >= 1000]
    if rank == 0:
        summary = {
            f"{kind}_{how}_min_vs_raw_from_1MiB": min(r[f"{kind}_{how}_vs_raw"] for r in big)
            if big else None
            for kind in a.transports for how in HOWS
        }  # fmt: skip
        emit("ingest", rows, summary, world=world, backend=dist.get_backend(),
             transports=a.transports)  # fmt: skip
    raw_ex.close(drain=True)
    cd.destroy_distributed()


def _plane_fns(kind: str, plane: cd.DataPlane, batch, n: int) -> dict[str, tuple]:
    """The three timed ingestions of ``plane`` as ``(setup, fn)``: ``kind:copy``,
    ``kind:donate`` and ``kind:staged``."""

    def copying() -> None:
        plane.put(batch)
        plane.flush()

    def donating() -> None:
        plane.put(batch, donate=True)
        plane.flush()

    def produce() -> None:  # untimed: a producer writing in place
        with plane.staged(n) as rows:
            for k, v in batch.items():
                rows[k].copy_(v)

    return {
        f"{kind}:copy": (None, copying),
        f"{kind}:donate": (None, donating),
        f"{kind}:staged": (produce, plane.flush),
    }


def _print(kib: int, row: dict, transports: list[str]) -> None:
    shm = f", raw shm {row['raw_shm_ms']:.2f} ms" if "raw_shm_ms" in row else ""
    print(f"{kib:>6} KiB/peer  raw gloo {row['raw_ms']:.2f} ms ({row['raw_gbps']:.2f} GB/s){shm}")
    for kind in transports:
        cells = "  ".join(
            f"{how} {row[f'{kind}_{how}_ms']:.2f} ms ({row[f'{kind}_{how}_vs_raw']:.2f}x)"
            for how in HOWS
        )
        print(f"        {kind:>5}: {cells}", flush=True)


if __name__ == "__main__":
    main(__import__("sys").argv[1:])
