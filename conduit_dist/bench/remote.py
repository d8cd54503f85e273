"""``python -m conduit_dist.bench remote``: a learner sampling from a store in another process.

Side by side in one run, Atari-like transitions (two ``4x84x84`` uint8 frames, ~56 KB an item),
``--items`` of them put by one process, and a learner in a second process drawing uniform batches
of ``--batch`` (default 256, ~14.5 MB a batch) from them, three ways:

- ``conduit``: a two-rank gloo plane (``learner_ranks=[0]``, ``schedule="sync"``); rank 1 puts
  every item and then calls ``flush()`` once per round, rank 0 ``fetch``es. ``--placement
  local`` (the default, the neutral setting) keeps every item on rank 1's shard, so the whole
  batch crosses processes, as it does for the baseline; ``round_robin`` spreads the items over
  both shards (about half of each batch is then the learner's own), the favourable setting.
- ``conduit_shm``: the same plane with ``TransportConfig(shared_memory=True)``: the rows cross
  through ``/dev/shm`` (written there by the store's gather, copied out once by the learner), not
  gloo's socket.
- ``raw``: the floor of any remote sampler over gloo in the same two processes: rank 1 gathers
  ``--batch`` random rows of its ``[items, bytes]`` tensor (``index_select`` into a reused
  buffer) and sends them, rank 0 receives into a reused buffer. Nothing else: no request, no
  bookkeeping, no unpacking.
- ``torchrl``: TorchRL's ``ReplayBuffer`` (``LazyTensorStorage``, uniform sampling) hosted on a Ray
  actor (``service_backend="ray"``) with its ``distributed`` transport on gloo, sampled from this
  process (``pip install -e ".[bench]"`` installs ``ray``).

``conduit``, ``conduit_shm`` and ``raw`` alternate call by call in one spawned pair of processes
(each timed on the learner, from the call to the batch in its memory); the ``torchrl`` block runs
in this process after each pair's block, ``--repeats`` times, so drift hits all of them alike.
Every figure is the median over calls, then over repeats. The JSON line's ``summary``:
``conduit_ms``, ``raw_ms``, ``torchrl_ms`` (per batch), ``conduit_vs_torchrl`` (TorchRL's time
over conduit's: > 1 is faster), ``raw_vs_torchrl`` (the most any gloo sampler could reach here)
and ``conduit_vs_raw``; ``conduit_shm_ms``, ``conduit_shm_vs_torchrl`` and
``conduit_shm_vs_raw`` likewise.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import conduit_dist as cd
from conduit_dist.bench.common import emit, number
from conduit_dist.bench.store import make_batch

CHUNK = 500  # items per put / extend


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pair(rank: int, a: argparse.Namespace, port: int, out: str) -> None:
    """One of the two spawned processes: build the plane, fill it, time ``conduit`` and ``raw``
    alternately (rank 0 the learner, rank 1 the store), write rank 0's medians to ``out``."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
    )  # fmt: skip
    torch.set_num_threads(1)
    cd.init_distributed()
    spec = cd.ExperienceSpec.from_batch(make_batch("atari", 1))
    planes = {}
    for name, shm in (("conduit", False), ("conduit_shm", True)):
        planes[name] = cd.DataPlane(
            spec, a.items, learner_ranks=[0], placement=a.placement, schedule="sync", seed=rank,
            transport=cd.TransportConfig(shared_memory=shm),
        )  # fmt: skip
    try:
        # the raw floor's store: the same items as flat rows, on the store's process
        flat = None
        if rank == 1:
            for i in range(0, a.items, CHUNK):
                batch = make_batch("atari", min(CHUNK, a.items - i), seed=i)
                for p in planes.values():
                    p.put(batch)
            flat = torch.randint(0, 256, (a.items, spec.record_bytes), dtype=torch.uint8)
        rows = torch.empty(a.batch, spec.record_bytes, dtype=torch.uint8)  # sent / received
        gen = torch.Generator().manual_seed(rank)

        def conduit(plane: cd.DataPlane) -> None:
            if rank == 0:
                plane.fetch(a.batch)
            else:
                plane.flush()

        def raw() -> None:
            if rank == 1:
                idx = torch.randint(0, a.items, (a.batch,), generator=gen)
                torch.index_select(flat, 0, idx, out=rows)
                dist.send(rows, 0)
            else:
                dist.recv(rows, 1)

        for p in planes.values():  # the first round ingests
            conduit(p)
        fns = {name: partial(conduit, p) for name, p in planes.items()} | {"raw": raw}
        times: dict[str, list[float]] = {name: [] for name in fns}
        for i in range(a.warmup + a.samples):
            for name, fn in fns.items():
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                if i >= a.warmup:
                    times[name].append(time.perf_counter() - t0)
        if rank == 0:
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            Path(out).write_text(json.dumps(med))
    finally:
        for p in planes.values():
            p.close()
        cd.destroy_distributed()


def _torchrl_buffer(a: argparse.Namespace):
    """TorchRL's replay buffer on a Ray actor with the gloo transport, filled with the items."""
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    rb = ReplayBuffer(
        storage=partial(LazyTensorStorage, a.items),
        batch_size=a.batch,
        service_backend="ray",
        service_backend_options={
            "remote_config": {"num_cpus": 1},
            "ray_init_config": {"num_cpus": 2, "include_dashboard": False, "log_to_driver": False},
        },
        transport="distributed",
        transport_options={"backend": "gloo"},
    )
    for i in range(0, a.items, CHUNK):
        n = min(CHUNK, a.items - i)
        rb.extend(TensorDict(make_batch("atari", n, seed=i), batch_size=[n]))
    if len(rb) != a.items:
        raise RuntimeError(f"torchrl: the buffer holds {len(rb)} items, expected {a.items}")
    return rb


def _torchrl_block(rb, a: argparse.Namespace) -> float:
    """Median ms per ``rb.sample()`` of ``a.batch`` items over ``a.samples`` calls."""
    times = []
    for i in range(a.warmup + a.samples):
        t0 = time.perf_counter()
        got = rb.sample()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    if got["obs"].shape[0] != a.batch:
        raise RuntimeError(f"torchrl: a sample of {got['obs'].shape[0]} items, asked {a.batch}")
    return statistics.median(times) * 1e3


def main(argv: list[str]) -> None:
    """Run the remote-sampling benchmark and print the JSON line last."""
    p = argparse.ArgumentParser(prog="python -m conduit_dist.bench remote")
    p.add_argument("--items", type=number(int, 1), default=4000, help="items in the store")
    p.add_argument("--batch", type=number(int, 1), default=256, help="items per sample")
    p.add_argument("--samples", type=number(int, 1), default=40, help="timed calls per block")
    p.add_argument("--warmup", type=number(int, 0), default=5)
    p.add_argument("--repeats", type=number(int, 1), default=3, help="blocks of each")
    p.add_argument("--placement", choices=("local", "round_robin"), default="local")
    p.add_argument("--no-torchrl", action="store_true", help="conduit and raw only")
    a = p.parse_args(argv)
    if a.batch > a.items:
        p.error(f"--batch {a.batch} is larger than --items {a.items}: the store holds fewer")
    rb = None
    if not a.no_torchrl:
        try:
            rb = _torchrl_buffer(a)
        except ImportError as exc:
            p.error(f"torchrl with ray is needed (pip install -e '.[bench]'): {exc}")
    blocks: dict[str, list[float]] = {"conduit": [], "conduit_shm": [], "raw": [], "torchrl": []}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(a.repeats):
                out = os.path.join(tmp, f"pair{r}.json")
                mp.spawn(_pair, args=(a, _free_port(), out), nprocs=2, join=True)
                med = json.loads(Path(out).read_text())
                for k in ("conduit", "conduit_shm", "raw"):
                    blocks[k].append(med[k])
                if rb is not None:
                    blocks["torchrl"].append(_torchrl_block(rb, a))
    finally:
        if rb is not None:
            rb.shutdown()
    ms = {k: statistics.median(v) for k, v in blocks.items() if v}
    summary = {f"{k}_ms": v for k, v in ms.items()}
    summary["conduit_vs_raw"] = ms["raw"] / ms["conduit"]
    summary["conduit_shm_vs_raw"] = ms["raw"] / ms["conduit_shm"]
    if "torchrl" in ms:
        summary["conduit_vs_torchrl"] = ms["torchrl"] / ms["conduit"]
        summary["conduit_shm_vs_torchrl"] = ms["torchrl"] / ms["conduit_shm"]
        summary["raw_vs_torchrl"] = ms["torchrl"] / ms["raw"]
    mb = a.batch * cd.ExperienceSpec.from_batch(make_batch("atari", 1)).record_bytes / 1e6
    for k, v in ms.items():
        print(f"{k:>8}: {v:.2f} ms per batch of {a.batch} ({mb / v:.2f} GB/s)", flush=True)
    results = [{"system": k, "ms": v, "blocks": blocks[k]} for k, v in ms.items()]
    emit(
        "remote", results, summary, items=a.items, batch=a.batch, placement=a.placement,
        repeats=a.repeats,
    )  # fmt: skip
