"""``torchrun --standalone --nproc_per_node=4 -m conduit_dist.bench tokens --peer transferqueue``:
the same GRPO-shaped global batches through TransferQueue and through ``cd.TokenPlane``.

Roles: the first ``--learners`` ranks learn (default half the world), the others produce. Each
sample, every producer generates its share of ``G`` groups of ``--group-size`` responses
(``bench tokens``' workload, ``token_baselines.Data``: lognormal lengths, median 256 tokens, 1%
at 6,144-8,192; int32 tokens, float32 log-probs, bool loss mask, a float32 reward and the int64
group id per response), untimed; then each pass delivers that global batch, the passes' order
rotating from sample to sample:

- ours: the producers ``TokenPlane.put`` (a copy into their own shard), then the producers
  ``flush`` and the learners ``fetch(G, --token-budget)``: one round (the group table
  all-gathered, the token-balanced plan, one exchange), the learners holding packed
  micro-batches with ``cu_seqlens``. The round itself tells the learners the batch is there
  (``ours_ms``); a second pass puts the same groups again with a barrier between the puts and the
  round, as TransferQueue's pass has (``ours_with_barrier_ms``, ``ours_put_ms``,
  ``ours_delivery_ms``);
- ``transferqueue`` (``bench/tokens_tq.py``): the producers ``put`` into its storage units (the
  data moves there), a barrier (the cheapest way its learners can know the batch is complete:
  its streaming loader polls once a second), then each learner reads its share through its
  streaming loader (the ``SeqlenBalancedSampler`` over whole groups, ``get_meta`` and
  ``get_data``, micro-batches of ``--tq-micro-groups`` groups as jagged nested tensors: packed
  values and offsets);
- ``transferqueue_client``, the neutral variant: the same through its client without the loader
  (whose chunking deep-copies the batch's metadata once per micro-batch), micro-batches cut as
  views of the returned packed values;
- ``raw``: one ``all_to_all_single`` on the same group moving ours' delivered bytes (each
  learner's received bytes, split evenly over the producers), right after ours' second pass;
  and ``raw_with_gather``: the token round's meta all-gather (its steady-state size), then the
  same exchange: the least any round pays that learns the batch's layout collectively
  (``bound_vs_raw_exchange``: its time over the raw exchange's).

Timing: each rank's wall from the barrier before the puts (``*_ms``, end to end: the puts count)
or from the barrier after them (``*_delivery_ms``: the batch available) to its end (a learner's:
holding its micro-batches); a sample's time is the slowest rank's; figures are medians over
``--samples`` after ``--warmup``. GB/s: the batch's sequence data (9 bytes a token, 20 a
sequence) over that time.

Checks, every sample and pass (untimed): ``digests_equal_*`` (every group's members hashed field
by field, in any order, equal to what its producer put; no group missing or extra) and
``groups_whole_*`` (every group's members arrive together, in one micro-batch of one learner,
once).

Summary: ``speedup_vs_transferqueue`` (its end-to-end time over ours' ``ours_ms``; the smallest
over the sizes), ``speedup_vs_transferqueue_same_barrier`` (over ``ours_with_barrier_ms``),
``delivery_speedup_vs_transferqueue``, the same against ``transferqueue_client``,
``ours_vs_raw_exchange`` (ours' delivery over the raw exchange; the largest),
``bound_vs_raw_exchange`` (the largest), the checks over
every size and sample, and each size's row.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

import conduit_dist as cd
from conduit_dist.bench.common import emit, number
from conduit_dist.bench.token_baselines import FIELDS, MAX_LEN, SEQ_BYTES, TOKEN_BYTES, Data
from conduit_dist.bench.token_checks import judge, produced, received, summarise

PEERS = ("transferqueue",)
# ours (put, barrier, round), ours without the barrier, TransferQueue through its loader and
# through its client
SIDES = ("ours", "ours_direct", "tq", "tqc")
PEER_SIDES = {"tq": "transferqueue", "tqc": "transferqueue_client"}


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected group counts >= 1, got {text!r}")
    return sizes


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m conduit_dist.bench tokens --peer transferqueue")
    p.add_argument("--peer", choices=PEERS, required=True)
    p.add_argument(
        "--sizes", type=_sizes, default=[64, 128, 256, 512],
        help="groups per global batch, comma-separated (each a multiple of the learners and "
        "of the producers)",
    )  # fmt: skip
    p.add_argument("--learners", type=number(int, 1), default=None, help="default: world // 2")
    p.add_argument("--group-size", type=number(int, 1), default=8)
    p.add_argument("--median", type=number(float, 16), default=256.0, help="median length")
    p.add_argument("--token-budget", type=number(int, MAX_LEN), default=16_384)
    p.add_argument(
        "--tq-micro-groups", type=number(int, 1), default=4,
        help="groups per micro-batch of TransferQueue's loader (4 x 8 x ~490 mean tokens: about "
        "ours' 16,384-token budget)",
    )  # fmt: skip
    p.add_argument(
        "--shared-memory", choices=("auto", "off"), default="auto",
        help="ours' sections between the ranks of one host: /dev/shm (auto, the plane's "
        "default) or gloo (off)",
    )  # fmt: skip
    p.add_argument("--samples", type=number(int, 1), default=7)
    p.add_argument("--warmup", type=number(int, 0), default=2)
    return p.parse_args(argv)


# -------------------------------------------------------------------------------- the sides


def _ours(tp, d: Data | None, groups: int, budget: int, split: bool) -> tuple[list[float], list]:
    """Ours' pass: ``split``: put, barrier, round (end to end, put, delivery); else put and
    round, the round itself telling the learners the batch is there (end to end only)."""
    dist.barrier()
    t0 = time.perf_counter()
    if d is not None:
        tp.put(*d.batch())
    if split:
        dist.barrier()
    t1 = time.perf_counter()
    mbs = []
    if d is not None:
        tp.flush()
    else:
        taken = tp.fetch(groups, budget)
        mbs = [{**mb.fields, "cu_seqlens": mb.cu_seqlens} for mb in taken]
    t2 = time.perf_counter()
    return ([t2 - t0, t1 - t0, t2 - t1] if split else [t2 - t0]), mbs


def _tq(tq, d: Data | None, partition: str, take) -> tuple[list[float], list]:
    dist.barrier()
    t0 = time.perf_counter()
    if d is not None:
        tq.put(d, partition)
    dist.barrier()
    t1 = time.perf_counter()
    mbs = take() if d is None else []
    t2 = time.perf_counter()
    return [t2 - t0, t1 - t0, t2 - t1], mbs


def _raw(tp, recv: torch.Tensor, send: torch.Tensor, out_splits: list, in_splits: list) -> float:
    """One all-to-all of the same bytes on the plane's own exchange: its group and its
    transport (shared memory where ours' sections go through it, else gloo)."""
    dist.barrier()
    t = time.perf_counter()
    tp.ex.all_to_all(recv.view(-1, 1), send.view(-1, 1), out_splits, in_splits, -1, "raw")
    return time.perf_counter() - t


def _raw_with_gather(tp, recv, send, out_splits: list, in_splits: list) -> float:
    """The bound of any round that learns the batch's layout collectively: one all-gather of a
    token round's meta row (its size: the meta and 16 table rows, as ``TokenRound._gather``
    sends in steady state), then the raw exchange, on the same exchange."""
    from conduit_dist.tokens.round import META_WIDTH
    from conduit_dist.tokens.select import WIDTH

    row = torch.zeros(META_WIDTH + 16 * WIDTH, dtype=torch.int64)
    dist.barrier()
    t = time.perf_counter()
    tp.ex.all_gather_start(row, -1).wait()
    tp.ex.all_to_all(recv.view(-1, 1), send.view(-1, 1), out_splits, in_splits, -1, "raw")
    return time.perf_counter() - t


def _raw_buffers(tp, learners: list[int], producers: list[int]):
    """Buffers moving each learner's last-round bytes from the producers (split evenly)."""
    me, world = dist.get_rank(), dist.get_world_size()
    wire = torch.zeros(world, dtype=torch.int64)
    if me in learners:
        wire[me] = tp.last.wire_bytes
    dist.all_reduce(wire)
    share = np.zeros((world, world), np.int64)  # [sender, receiver]
    for li in learners:
        parts = np.diff(np.linspace(0, int(wire[li]) // 8, len(producers) + 1).astype(np.int64))
        share[producers, li] = parts * 8
    in_splits, out_splits = share[me].tolist(), share[:, me].tolist()
    # both touched before the timing, as ours' reused buffers are
    send = torch.ones(sum(in_splits), dtype=torch.uint8)
    return torch.zeros(sum(out_splits), dtype=torch.uint8), send, out_splits, in_splits


# --------------------------------------------------------------------------------- the sweep


def _size(a, tp, tq, groups: int, first_gid: int, roles) -> tuple[dict, dict]:
    """Every sample of one size: the slowest rank's median times per phase (``side``,
    ``side_put``, ``side_delivery``, ``raw``) and, on rank 0, the checks."""
    learners, producers = roles
    me, world = dist.get_rank(), dist.get_world_size()
    per, size = groups // len(producers), a.group_size
    share = groups * size // len(learners)
    micro = -(-share // (a.tq_micro_groups * size))  # the loader's micro-batches a learner
    rng = np.random.default_rng(1000 + me + 7919 * groups)
    times, verdicts = [], []
    for i in range(a.warmup + a.samples):
        base = first_gid + i * groups + (producers.index(me) * per if me in producers else 0)
        d = Data(rng, per, size, a.median, base) if me in producers else None
        part = f"bench_g{groups}_s{i}"
        if tq.loader is not None:
            tq.prepare(f"{part}_loader", share)
        t: dict[str, list[float]] = {}
        held: dict[str, list] = {}

        def ours(t=t, held=held, d=d) -> None:
            t["ours"], held["ours"] = _ours(tp, d, groups, a.token_budget, split=True)
            bufs = _raw_buffers(tp, learners, producers)
            t["raw"] = [_raw(tp, *bufs), _raw_with_gather(tp, *bufs)]

        def direct(t=t, held=held, d=d) -> None:  # the same groups again (consumed by now)
            t["ours_direct"], held["ours_direct"] = _ours(tp, d, groups, a.token_budget, False)

        def loader(t=t, held=held, d=d, part=part) -> None:
            t["tq"], held["tq"] = _tq(tq, d, f"{part}_loader", partial(tq.take, micro))

        def client(t=t, held=held, d=d, part=part) -> None:
            take = partial(tq.take_client, f"{part}_client", share)
            t["tqc"], held["tqc"] = _tq(tq, d, f"{part}_client", take)

        order = (ours, direct, loader, client)
        for fn in order[i % 4 :] + order[: i % 4]:
            fn()
        report: dict = {}
        if d is not None:
            report["put"] = produced(d)
        else:
            report |= {side: received(held[side], size) for side in SIDES}
            report["micro"] = {side: len(held[side]) for side in SIDES}
        reports = [None] * world
        dist.all_gather_object(reports, report)
        if me == 0:
            tq.clear(f"{part}_loader")
            tq.clear(f"{part}_client")
            verdicts.append(judge(reports, SIDES))
        if i >= a.warmup:
            times.append([x for side in SIDES for x in t[side]] + t["raw"])
    w = torch.tensor(times, dtype=torch.float64)  # [sample, phase]
    dist.all_reduce(w, op=dist.ReduceOp.MAX)
    phases = [
        f"{s}{p}"
        for s in SIDES
        for p in (("",) if s == "ours_direct" else ("", "_put", "_delivery"))
    ] + ["raw", "raw_gather"]
    ms = {k: statistics.median(w[:, j].tolist()) * 1e3 for j, k in enumerate(phases)}
    return ms, summarise(verdicts, SIDES) if me == 0 else {}


def main(argv: list[str]) -> None:
    """Run the sweep (every rank) and print the JSON line last on rank 0."""
    a = _parse(argv)
    from conduit_dist.bench import tokens_tq

    missing = tokens_tq.available()
    if missing is not None:
        raise SystemExit(f"bench tokens --peer transferqueue: {missing}")
    cd.init_distributed()
    torch.set_num_threads(1)
    world = dist.get_world_size()
    n_learners = a.learners or world // 2
    if not 1 <= n_learners < world:
        raise SystemExit(
            f"bench tokens --peer: --learners must leave at least one producer; got "
            f"{n_learners} learners in a world of {world} (run with --nproc_per_node >= 2)"
        )
    learners, producers = list(range(n_learners)), list(range(n_learners, world))
    for g in a.sizes:
        if g % len(learners) or g % len(producers):
            raise SystemExit(
                f"bench tokens --peer: --sizes: {g} groups is not a multiple of the "
                f"{len(learners)} learners and the {len(producers)} producers"
            )
    spec = cd.TokenSpec(
        {n: cd.Ragged(t, MAX_LEN) for n, t in FIELDS} | {"reward": ((), torch.float32)},
        group_size=a.group_size,
    )
    seqs = 2 * max(a.sizes) // len(producers) * a.group_size
    transport = cd.TransportConfig(shared_memory="auto" if a.shared_memory == "auto" else False)
    tp = cd.TokenPlane(
        spec, seqs, seqs * MAX_LEN // 8, learner_ranks=learners, producer_ranks=producers,
        transport=transport,
    )  # fmt: skip
    a.transport = "shared memory" if tp.ex.shm is not None else "gloo"  # ours' and the raw's
    rows, first_gid, tq, done = [], 0, None, False
    try:
        tq = tokens_tq.TQ(learners, a.group_size, a.tq_micro_groups * a.group_size)
        for groups in a.sizes:
            ms, checks = _size(a, tp, tq, groups, first_gid, (learners, producers))
            first_gid += (a.warmup + a.samples) * groups
            rows.append(_row(groups, a.group_size, ms, checks))
            if dist.get_rank() == 0:
                _progress(rows[-1])
        done = True
    finally:  # after a failure: no collective (a peer may be inside another one), Ray stopped
        if tq is not None:
            tq.close(failed=not done)
        elif dist.get_rank() == 0 and not done:
            import ray

            ray.shutdown()
        if done:
            tp.close()
        else:
            tp.abort()
    if dist.get_rank() == 0:
        _report(a, world, learners, producers, rows)
    cd.destroy_distributed()


def _progress(r: dict) -> None:
    parts = [f"{r['groups']:>4} groups: ours {r['ours_ms']:.1f} ms"]
    parts.append(f"(with the barrier {r['ours_with_barrier_ms']:.1f}, delivery")
    parts.append(f"{r['ours_delivery_ms']:.1f}, raw {r['raw_exchange_ms']:.1f},")
    parts.append(f"raw with the meta all-gather {r['raw_with_gather_ms']:.1f}),")
    for n in PEER_SIDES.values():
        parts.append(f"{n} {r[f'{n}_ms']:.1f} ms (delivery {r[f'{n}_delivery_ms']:.1f}),")
    parts.append(f"{r['speedup_vs_transferqueue']:.1f}x")
    print(" ".join(parts), flush=True)


def _row(groups: int, size: int, ms: dict, checks: dict) -> dict:
    """One size's figures (rank 0 has the checks; the other ranks' rows are empty)."""
    if not checks:
        return {}
    data = checks["tokens"] * TOKEN_BYTES + groups * size * SEQ_BYTES  # the batch's bytes
    row: dict = {"groups": groups, "sequences": groups * size, "token_data_mb": data / 1e6}
    for side, n in PEER_SIDES.items():
        row[f"speedup_vs_{n}"] = ms[side] / ms["ours_direct"]
        row[f"speedup_vs_{n}_same_barrier"] = ms[side] / ms["ours"]
        row[f"delivery_speedup_vs_{n}"] = ms[f"{side}_delivery"] / ms["ours_delivery"]
    row["ours_vs_raw_exchange"] = ms["ours_delivery"] / ms["raw"]
    row["raw_exchange_ms"] = ms["raw"]
    row["raw_with_gather_ms"] = ms["raw_gather"]
    row["bound_vs_raw_exchange"] = ms["raw_gather"] / ms["raw"]
    row["ours_ms"] = ms["ours_direct"]
    row["ours_gb_s"] = data / ms["ours_direct"] / 1e6
    row["ours_with_barrier_ms"] = ms["ours"]
    for side, n in {"ours": "ours", **PEER_SIDES}.items():
        if side != "ours":
            row[f"{n}_ms"] = ms[side]
            row[f"{n}_gb_s"] = data / ms[side] / 1e6
        row[f"{n}_put_ms"] = ms[f"{side}_put"]
        row[f"{n}_delivery_ms"] = ms[f"{side}_delivery"]
        row[f"{n}_delivery_gb_s"] = data / ms[f"{side}_delivery"] / 1e6
        whole = checks[f"{side}_whole"] and (side != "ours" or checks["ours_direct_whole"])
        digests = checks[f"{side}_digests"] and (side != "ours" or checks["ours_direct_digests"])
        row[f"digests_equal_{n}"], row[f"groups_whole_{n}"] = digests, whole
        row[f"balance_max_over_mean_{n}"] = checks[f"{side}_balance"]
        row[f"micro_batches_per_learner_{n}"] = checks[f"{side}_micro"]
    return row


def _report(a, world: int, learners: list[int], producers: list[int], rows: list[dict]) -> None:
    import transfer_queue

    summary: dict = {}
    for n in PEER_SIDES.values():  # the least speedup over the sizes
        for k in (f"speedup_vs_{n}", f"speedup_vs_{n}_same_barrier", f"delivery_speedup_vs_{n}"):
            summary[k] = min(r[k] for r in rows)
    summary["ours_vs_raw_exchange"] = max(r["ours_vs_raw_exchange"] for r in rows)
    summary["bound_vs_raw_exchange"] = max(r["bound_vs_raw_exchange"] for r in rows)
    for n in ("ours", *PEER_SIDES.values()):
        summary[f"digests_equal_{n}"] = all(r[f"digests_equal_{n}"] for r in rows)
        summary[f"groups_whole_{n}"] = all(r[f"groups_whole_{n}"] for r in rows)
    for k, v in summary.items():
        print(f"{k:>48}: {v:.4g}" if isinstance(v, float) else f"{k:>48}: {v}", flush=True)
    summary["speedup_vs_transferqueue_by_size"] = {
        str(r["groups"]): r["speedup_vs_transferqueue"] for r in rows
    }
    emit(
        "tokens_peer",
        rows,
        summary,
        peer=a.peer,
        transport=a.transport,
        peer_version=transfer_queue.__version__,
        world=world,
        learner_ranks=learners,
        producer_ranks=producers,
        sizes=a.sizes,
        group_size=a.group_size,
        median=a.median,
        token_budget=a.token_budget,
        tq_micro_batch_groups=a.tq_micro_groups,
        shared_memory=a.shared_memory,
        samples=a.samples,
        warmup=a.warmup,
    )
