"""``torchrun --standalone --nproc_per_node=4 -m conduit_dist.bench weights``: learners publish a
model's weights to producers through a ``TokenPlane``, against the raw collectives moving the
same bytes on the same ranks and against the path the plane had before (one learner packs the
whole model and broadcasts it; producers copy it in).

The first ``--learners`` ranks learn (data parallel: they hold the same weights), the rest
produce. The model is ``--gib`` GiB of bf16 in ``--tensors`` tensors. Each repeat publishes a
new version:

- ``ours``: learners ``publish_weights`` (each packs its part) then ``fetch`` one group each (the
  round that sends every part to every producer, bucket by bucket); producers ``flush`` (that
  round) then ``pull_weights`` (in place unless ``--copy``). Timed from a barrier to the last
  producer's pull returning (``time.monotonic``: one clock for the processes of a host).
- ``raw_p2p``: on buffers already packed, each learner's part sent to each producer
  (``batch_isend_irecv``, one message per part and producer), nothing packed, checked or
  loaded; ``raw_broadcast``: ``dist.broadcast`` of the whole buffer from rank 0;
  ``raw_schedule``: the routes the plane chose (``WeightsState.routes``: the same as
  ``raw_p2p`` on one host, a relay across hosts), phase by phase, on packed buffers.
- ``current``: the previous path: rank 0 packs the whole model (``WeightsState.publish``), the
  ranks all-gather a meta row (as a round does), ``dist.broadcast`` the buffer, producers copy
  it into their module.

Bytes each rank wrote to its sockets (``/proc/self/io`` ``wchar``) are measured over
``ours_send_now``; ``busiest_rank_bytes_share`` is the largest rank's share of their sum. With
``--shared-memory`` (the plane's transport option: each learner packs its part into a file in
``/dev/shm``, each producer copies the parts out) nothing crosses a socket: the share is then
of the bytes each rank packed for the others (``WeightsState.last``), and
``bytes_share_source`` says which. With ``--fsdp`` the learners hold the model sharded (FSDP2
``fully_shard`` over the learner ranks: each its rows of every tensor) and each sends what it
holds; the previous path still packs an unsharded copy on rank 0. After the timed repeats
every producer's loaded weights are digested against the learners'.

Summary: ``publish_s`` (median, ours with ``send_now``), ``gbps`` (bytes delivered, model size
times producers, over ``publish_s``), ``vs_raw`` (the fastest raw path's time over ours),
``vs_raw_p2p``, ``vs_raw_broadcast``, ``vs_raw_schedule``, ``schedule`` (the plane's),
``vs_current`` (the previous path's time over ours), the same three for the snapshot way
(``*_snapshot``, with ``pack_s_snapshot``: a learner's ``publish_weights``),
``busiest_rank_bytes_share`` and ``digests_equal``."""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

import conduit_dist as cd
from conduit_dist.bench.common import emit, number
from conduit_dist.flow.weights import WeightsState, parts
from conduit_dist.flow.weights_format import buffer_bytes, is_dtensor


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m conduit_dist.bench weights")
    p.add_argument("--learners", type=number(int, 1), default=2)
    p.add_argument("--gib", type=number(float, 0, strict=True), default=1.0, help="model size")
    p.add_argument("--tensors", type=number(int, 1), default=16)
    p.add_argument("--repeats", type=number(int, 1), default=5)
    p.add_argument("--bucket-mb", type=number(float, 0, strict=True), default=None)
    p.add_argument("--shared-memory", action="store_true", help="the plane's transport option")
    p.add_argument("--copy", action="store_true", help="producers copy (default: in place)")
    p.add_argument(
        "--fsdp", action="store_true",
        help="learners hold the model sharded (FSDP2 fully_shard over the learner ranks)",
    )  # fmt: skip
    p.add_argument("--timeout-s", type=number(float, 1), default=300.0)
    p.add_argument(
        "--emulated-hosts",
        type=number(float, 0, strict=True),
        default=None,
        metavar="MBIT",
        help="run (not under torchrun) on two emulated hosts joined by a link of this many "
        "Mbit/s (bench/hosts.py; root): learners on the first, producers on the second",
    )
    return p.parse_args(argv)


def _on_hosts(a: argparse.Namespace, argv: list[str]) -> None:
    """Launch this benchmark on two emulated hosts, ``--learners`` ranks on each, and print
    the first host's JSON line (with the link's rate)."""
    from conduit_dist.bench.hosts import EmulatedHosts

    i = argv.index("--emulated-hosts")
    args = ["-m", "conduit_dist.bench", "weights", *argv[:i], *argv[i + 2 :]]
    with EmulatedHosts(a.emulated_hosts) as hosts, tempfile.TemporaryDirectory() as logs:
        outs = hosts.launch(args, a.learners, logs, timeout_s=3000)
    line = json.loads(outs[0].strip().splitlines()[-1])
    line["link_mbit"] = a.emulated_hosts
    print(json.dumps(line), flush=True)


class _Model(nn.Module):
    """``gib`` GiB of bf16 in ``n`` tensors (one of them small, as a bias is)."""

    def __init__(self, gib: float, n: int) -> None:
        super().__init__()
        total = int(gib * (1 << 30)) // 2  # bf16 elements
        each = max(1, (total - 1000) // max(1, n - 1)) if n > 1 else total
        sizes = [each] * (n - 1) + [max(1, total - each * (n - 1))] if n > 1 else [total]
        self.ps = nn.ParameterList(
            nn.Parameter(torch.empty(s, dtype=torch.bfloat16), requires_grad=False) for s in sizes
        )

    def set_version(self, v: int) -> None:
        with torch.no_grad():
            for i, p in enumerate(self.ps):
                p.fill_(v + i / 64)


def _digest(module: nn.Module) -> str:
    """The module's state digest; a sharded one's whole tensors (a collective among the
    learners, which all call it in the same order)."""
    h = hashlib.blake2b(digest_size=16)
    for k, t in module.state_dict().items():
        if is_dtensor(t):
            t = t.full_tensor()
        h.update(k.encode())
        h.update(memoryview(t.detach().contiguous().view(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def _wchar() -> int:
    """Bytes this process passed to write-like calls, sockets included (Linux)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def _span(t0: float, t1: float, keep: list[float]) -> None:
    """The longest ``t1 - t0`` over the ranks (``t1`` = ``t0`` where a rank's end does not
    count), appended to ``keep`` on every rank."""
    t = torch.tensor([t1 - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    keep.append(float(t))


def _ours(a, model: _Model, learners: list[int], producers: list[int], send_now: bool) -> dict:
    """The plane's path; ``send_now``: learners ``publish_weights(send_now=True)`` (the round
    in the call packs as it sends), else ``publish_weights`` then ``fetch`` (packed at the
    publish, a snapshot, sent by the fetch's round)."""
    rank = dist.get_rank()
    spec = cd.TokenSpec({"tokens": cd.Ragged(torch.int32, 8)}, group_size=1)
    transport = cd.TransportConfig(
        timeout_s=a.timeout_s, weights_bucket_mb=a.bucket_mb,
        shared_memory=bool(a.shared_memory),
    )  # fmt: skip
    tp = cd.TokenPlane(spec, 1024, 1 << 16, learner_ranks=learners, producer_ranks=producers,
                       transport=transport)  # fmt: skip
    times, packs, wrote, sent = [], [], [], []
    gid = 0
    for v in range(1, a.repeats + 2):  # the first is a warm-up
        if rank in learners:
            model.set_version(v)
        elif rank == producers[0] and not send_now:  # a group for each learner's fetch
            n = len(learners)
            ids = torch.arange(gid, gid + n)
            tp.put({"tokens": torch.ones(4 * n, dtype=torch.int32), "group": ids},
                   torch.full((n,), 4))  # fmt: skip
            gid += n
        gc.collect()
        dist.barrier()
        w0, t0 = _wchar(), time.monotonic()
        if rank in learners:
            tp.publish_weights(model, send_now=send_now)
            t_pack = time.monotonic()
            if not send_now:
                tp.fetch(len(learners), 64)
            t1 = t0  # a learner's end does not count
        else:
            tp.flush()
            tp.pull_weights(model, in_place=not a.copy)
            t1 = time.monotonic()
        w1 = _wchar()
        _span(t0, t1, times)
        _span(t0, t_pack if rank in learners and not send_now else t0, packs)
        wrote.append(w1 - w0)
        sent.append(tp.weights.last.sent)
    digest = _digest(model)
    last = vars(tp.weights.last)
    nbytes = buffer_bytes(model)  # the routes the plane's transfers took, for the raw replay
    owned = [[p] for p in parts(nbytes, len(learners))]
    schedule, phases = tp.weights.routes(learners, owned, producers)
    tp.close()
    return {"times": times[1:], "packs": packs[1:], "wrote": wrote[1:], "sent": sent[1:],
            "digest": digest, "last": last, "routes": (schedule, phases)}  # fmt: skip


def _raw(a, nbytes: int, learners: list[int], producers: list[int], routes) -> dict:
    """The raw collectives on packed buffers: each learner's part to each producer; one
    broadcast; and the routes the plane chose (``routes``: a relay across hosts), phase by
    phase."""
    rank = dist.get_rank()
    buf = torch.ones(nbytes, dtype=torch.uint8)
    ranges = parts(nbytes, len(learners))
    p2p, bcast, chosen = [], [], []
    for _ in range(a.repeats + 1):
        dist.barrier()
        t0 = time.monotonic()
        ops = []
        for src, (lo, hi) in zip(learners, ranges):
            for dst in producers:
                if rank == src:
                    ops.append(dist.P2POp(dist.isend, buf[lo:hi], dst))
                elif rank == dst:
                    ops.append(dist.P2POp(dist.irecv, buf[lo:hi], src))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        _span(t0, time.monotonic(), p2p)
        dist.barrier()
        t0 = time.monotonic()
        dist.broadcast(buf, learners[0])
        _span(t0, time.monotonic(), bcast)
        dist.barrier()
        t0 = time.monotonic()
        for phase in routes[1]:
            ops = [dist.P2POp(dist.isend if rank == s else dist.irecv, buf[lo:hi],
                              d if rank == s else s)
                   for s, d, lo, hi in phase if rank in (s, d)]  # fmt: skip
            for work in dist.batch_isend_irecv(ops) if ops else []:
                work.wait()
        _span(t0, time.monotonic(), chosen)
    return {"p2p": p2p[1:], "broadcast": bcast[1:], "schedule": chosen[1:]}


def _current(a, model: _Model, learners: list[int]) -> dict:
    """The previous path: the first learner packs the whole model, a meta all-gather, one
    broadcast, producers copy it in."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ws = WeightsState()
    times = []
    for v in range(1, a.repeats + 2):
        if rank in learners:
            model.set_version(v)
        gc.collect()
        dist.barrier()
        t0 = time.monotonic()
        meta = torch.zeros(world * 2, dtype=torch.int64)
        mine = torch.zeros(2, dtype=torch.int64)
        if rank == learners[0]:
            ws.publish(model)
            mine[:] = torch.tensor([ws.version, ws.buf.numel()])
        dist.all_gather_into_tensor(meta, mine)
        version, nbytes = (int(x) for x in meta.view(world, 2)[learners[0]])
        buf = ws.buf if rank == learners[0] else ws._buffers.take(nbytes)
        dist.broadcast(buf, learners[0])
        t1 = t0
        if rank not in learners:
            ws.hold(version, buf)
            ws.pull(model)
            t1 = time.monotonic()
        del buf
        _span(t0, t1, times)
    return {"times": times[1:], "digest": _digest(model)}


def main(argv: list[str]) -> None:
    """Run the benchmark (see the module docstring) and print its JSON line last."""
    a = _parse(argv)
    if a.emulated_hosts is not None:
        if "RANK" in os.environ:
            raise SystemExit(
                "bench weights: --emulated-hosts launches the ranks itself: run it "
                "with python, not under torchrun"
            )
        _on_hosts(a, argv)
        return
    cd.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    if not 1 <= a.learners < world:
        raise SystemExit(
            f"bench weights: --learners: expected 1 <= learners < world size {world} (at "
            f"least one producer), got {a.learners}"
        )
    learners, producers = list(range(a.learners)), list(range(a.learners, world))
    model = _Model(a.gib, a.tensors)
    model.set_version(0)
    nbytes = sum(p.numel() * 2 for p in model.ps)
    plain = model  # the previous path packs an unsharded model on one rank
    if a.fsdp:  # each learner holds its rows of every tensor: the plane sends shard by shard
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh("cpu", learners)  # built on every rank (a collective)
        if rank in learners:
            model = _Model(a.gib, a.tensors)
            fully_shard(model, mesh=mesh)
            model.set_version(0)
    now = _ours(a, model, learners, producers, True)
    gc.collect()
    snap = _ours(a, model, learners, producers, False)
    gc.collect()
    raw = _raw(a, buffer_bytes(model), learners, producers, now["routes"])
    gc.collect()
    current = _current(a, plain, learners)
    digests = [None] * world
    dist.all_gather_object(digests, (now["digest"], snap["digest"], current["digest"]))
    wrote = [None] * world
    dist.all_gather_object(wrote, (now["wrote"], now["sent"], snap["wrote"]))
    if rank != 0:
        dist.destroy_process_group()
        return
    med = statistics.median
    t_now, t_snap, t_cur = med(now["times"]), med(snap["times"]), med(current["times"])
    t_p2p, t_bc, t_sched = med(raw["p2p"]), med(raw["broadcast"]), med(raw["schedule"])
    t_raw = min(t_p2p, t_bc, t_sched)
    by_rank = [med(w[0]) for w in wrote]
    sched = [med(w[1]) for w in wrote]
    by_rank_snap = [med(w[2]) for w in wrote]
    # the sockets where the parts crossed them; the bytes packed for others through /dev/shm
    over_sockets = sum(by_rank) > 0.01 * nbytes
    shares, source = (by_rank, "sockets") if over_sockets else (sched, "packed into /dev/shm")
    results = [
        {"path": "ours_send_now", "s": t_now, "samples": now["times"],
         "socket_bytes_by_rank": by_rank, "schedule_bytes_by_rank": sched,
         "last_transfer": now["last"]},
        {"path": "ours_snapshot", "s": t_snap, "samples": snap["times"],
         "pack_s": med(snap["packs"]), "socket_bytes_by_rank": by_rank_snap},
        {"path": "raw_p2p", "s": t_p2p, "samples": raw["p2p"]},
        {"path": "raw_broadcast", "s": t_bc, "samples": raw["broadcast"]},
        {"path": "raw_schedule", "s": t_sched, "samples": raw["schedule"],
         "schedule": now["routes"][0]},
        {"path": "current", "s": t_cur, "samples": current["times"]},
    ]  # fmt: skip
    summary = {
        "publish_s": round(t_now, 4),
        "gbps": round(nbytes * len(producers) / t_now / 1e9, 3),
        "vs_raw": round(t_raw / t_now, 3),
        "vs_raw_p2p": round(t_p2p / t_now, 3),
        "vs_raw_broadcast": round(t_bc / t_now, 3),
        "vs_raw_schedule": round(t_sched / t_now, 3),
        "schedule": now["routes"][0] if not a.shared_memory else "shm",
        "vs_current": round(t_cur / t_now, 3),
        "publish_s_snapshot": round(t_snap, 4),
        "vs_raw_snapshot": round(t_raw / t_snap, 3),
        "vs_current_snapshot": round(t_cur / t_snap, 3),
        "pack_s_snapshot": round(med(snap["packs"]), 4),
        "busiest_rank_bytes_share": round(max(shares) / max(1, sum(shares)), 3),
        "bytes_share_source": source,
        "busiest_rank_bytes_share_schedule": round(max(sched) / max(1, sum(sched)), 3),
        "digests_equal": len({d for row in digests for d in row}) == 1,
    }
    emit(
        "weights", results, summary, learners=len(learners), producers=len(producers),
        model_bytes=nbytes, tensors=a.tensors, bucket_mb=a.bucket_mb,
        shared_memory=a.shared_memory, load="copy" if a.copy else "in_place", fsdp=a.fsdp,
    )  # fmt: skip
    dist.destroy_process_group()
