"""``python -m conduit_dist.bench placement`` (and under torchrun for the multi-rank part).

Four parts, one JSON line last:

1. **Disk tier** (plain ``python``, one rank): a store of ``--gib`` GiB of Atari-like
   transitions whose host tier holds a quarter and the disk tier the rest; every item fetched
   is checked, and sample throughput is compared with a host-only store of the same size.
2. **Delivery per round** (under torchrun, 2+ ranks, colocated): median measured delivery time of
   ``uniform`` sampling with ``round_robin`` placement against ``stratified`` with
   ``bandwidth_aware``, same volume.
3. **Background demotion** (one rank): a full host+disk store, put+fetch per iteration with
   demotion inside the round against demotion between rounds on the worker thread, with 20 ms of
   (off-CPU) learner compute between iterations.
4. **Declared topologies** (predicted by the bandwidth model with datasheet numbers): nodes of 8
   GPUs with NVLink inside (``host``) and InfiniBand between (``net``), colocated and
   disaggregated roles, balanced and skewed producers; the three policies under both samplers,
   each priced as the planner prices plans, and the best equal-inflow placement a linear program
   finds (``conduit_dist/bench/lp_bound.py``) as a reference for what any placement could gain.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist

import conduit_dist as cd
from conduit_dist.bench.common import emit, number
from conduit_dist.collectives.model import BandwidthModel
from conduit_dist.collectives.topology import Topology
from conduit_dist.placement import BandwidthAware, spread
from conduit_dist.registry import bound_sampler

ITEM = (4, 84, 84)


def _atari(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    pattern = torch.arange(28224, dtype=torch.int64).remainder(256).to(torch.uint8)
    obs = (ids.remainder(251).to(torch.uint8)[:, None] + pattern[None, :]).view(-1, *ITEM)
    return {"obs": obs, "id": ids.to(torch.int64), "reward": ids.float()}


def _check(batch: dict[str, torch.Tensor]) -> None:
    want = _atari(batch["id"])
    assert torch.equal(batch["obs"], want["obs"]) and torch.equal(batch["reward"], want["reward"])


def disk_tier(gib: float, batch: int, fetches: int) -> dict:
    """Fill a host+disk store of ``gib`` GiB, sample it, compare with host-only."""
    cd.init_distributed()
    spec = cd.ExperienceSpec.from_batch(_atari(torch.arange(1)))
    items = int(gib * 2**30 // spec.record_bytes)
    host = items // 4
    out = {
        "items": items,
        "record_bytes": spec.record_bytes,
        "gib": items * spec.record_bytes / 2**30,
    }
    with tempfile.TemporaryDirectory(prefix="conduit_disk_") as d:
        for name, tiers in (
            ("host+disk", [("host", host), ("disk", items - host)]),
            ("host", None),
        ):
            t0 = time.perf_counter()
            plane = cd.DataPlane(spec, items, seed=0, storage=cd.Tiers(tiers, disk_dir=d))
            for start in range(0, items, 2048):
                plane.put(_atari(torch.arange(start, min(items, start + 2048))))
                plane.flush()
            fill = time.perf_counter() - t0
            last = items - (items - 1) // 2048 * 2048  # the last round's items
            # full, so room for as many again was made after it (host+disk: the oldest evicted)
            want = items - min(last, host) if tiers else items
            assert len(plane) == want, (len(plane), want)
            seen = 0
            t1 = time.perf_counter()
            for _ in range(fetches):
                b = plane.fetch(batch)
                _check(b)
                seen += b["id"].numel()
            rate = seen / (time.perf_counter() - t1)
            out[name] = {"fill_s": fill, "sample_items_per_s": rate, **plane.store_stats()}
            plane.close()
    out["disk_over_host_sampling"] = (
        out["host+disk"]["sample_items_per_s"] / out["host"]["sample_items_per_s"]
    )
    return out


def demotion(items: int, batch: int, rounds: int, gap_s: float) -> dict:
    """Median put+fetch ms per iteration of a full host+disk store: demotion inline vs between
    rounds on the worker thread, with ``gap_s`` of learner compute (off-CPU: a sleep) between."""
    spec = cd.ExperienceSpec.from_batch(_atari(torch.arange(1)))
    host = items // 4
    out = {"items": items, "gap_ms": gap_s * 1e3}
    with tempfile.TemporaryDirectory(prefix="conduit_demote_") as d:
        for name, bg in (("inline", False), ("background", True)):
            plane = cd.DataPlane(
                spec,
                items,
                seed=0,
                storage=cd.Tiers(
                    [("host", host), ("disk", items - host)], disk_dir=d, background=bg
                ),
            )
            for start in range(0, items + batch, 2048):  # full: every round demotes and evicts
                plane.put(_atari(torch.arange(start, start + 2048)))
                plane.flush()
            times, nxt = [], items + batch + 2048
            for _ in range(rounds):
                time.sleep(gap_s)
                t0 = time.perf_counter()
                plane.put(_atari(torch.arange(nxt, nxt + batch)))
                b = plane.fetch(batch)
                times.append(time.perf_counter() - t0)
                nxt += batch
            _check(b)
            out[f"{name}_ms"] = statistics.median(times) * 1e3
            out[f"{name}_stats"] = plane.store_stats()
            plane.close()
    out["background_cut"] = 1 - out["background_ms"] / out["inline_ms"]
    return out


def delivery(rounds: int, batch: int) -> dict:
    """Median measured delivery ms per round: uniform+round_robin vs stratified+bandwidth_aware.

    Delivery is the round's sampling gather plus its delivery exchange (rows a learner reads from
    its own shard are gathered straight into its batch and skip the exchange, so the exchange
    alone would flatter the local plan); the exchange alone is reported beside it.
    """
    spec = cd.ExperienceSpec.from_batch(_atari(torch.arange(1)))
    rank = dist.get_rank()
    res = {}
    for sampling, placement in (("uniform", "round_robin"), ("stratified", "bandwidth_aware")):
        plane = cd.DataPlane(
            spec, 8 * batch, seed=1, sampler=sampling, placement=placement, schedule="sync"
        )
        times, exchange = [], []
        for it in range(rounds + 3):
            plane.put(_atari(rank * 10**6 + it * batch + torch.arange(batch)))
            b = plane.fetch(batch)
            if it >= 3:
                times.append(plane.stats.sample_ms + plane.stats.deliver_ms)
                exchange.append(plane.stats.deliver_ms)
        _check(b)
        plane.close()
        t = torch.tensor([statistics.median(times), statistics.median(exchange)]).double()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        res[f"{sampling}+{placement}"] = float(t[0])
        res[f"{sampling}+{placement} exchange"] = float(t[1])
    res["stratified_delivery_cut"] = (
        1 - res["stratified+bandwidth_aware"] / res["uniform+round_robin"]
    )
    res["stratified_exchange_cut"] = (
        1 - res["stratified+bandwidth_aware exchange"] / res["uniform+round_robin exchange"]
    )
    return res


def _topologies() -> dict[str, tuple[Topology, np.ndarray, np.ndarray]]:
    """name -> (topology, learner mask, items put per rank per round)."""
    out = {}
    for nodes in (2, 4, 16):
        topo = Topology.from_hosts([f"n{i // 8}" for i in range(8 * nodes)])
        world = topo.world
        out[f"{nodes}x8 colocated"] = (topo, np.ones(world, bool), np.full(world, 64))
        learners = np.zeros(world, bool)
        learners[:8] = True
        put = np.where(learners, 0, 64)
        out[f"{nodes}x8 disaggregated"] = (topo, learners, put)  # node 0 learns, others act
    hosts = [f"n{i}" for i in range(4) for _ in range(8)] + [
        f"p{i}" for i in range(4) for _ in range(4)
    ]
    topo = Topology.from_hosts(hosts)  # mixed nodes: 4 of 8 GPUs, 4 of 4 GPUs
    out["mixed 8+4 colocated"] = (topo, np.ones(topo.world, bool), np.full(topo.world, 64))
    skew = np.full(topo.world, 32)
    skew[:8] = 160  # one node's envs are 5x faster
    out["mixed skewed producers"] = (topo, np.ones(topo.world, bool), skew)
    return out


def predicted(record_bytes: int, batch: int, bound: bool = True) -> dict:
    """Predicted ingest + steady-state delivery seconds per (topology, sampling, policy).

    Each plan is priced as the planner prices it (``BandwidthAware.price``): the model's time of
    the ingest exchange plus that of the delivery exchange once every shard the plan
    feeds is full (the sampler's expected counts). With ``bound`` (and SciPy installed), the best
    equal-inflow placement found by linear programming (:mod:`conduit_dist.bench.lp_bound`) is
    priced too, as a reference for what any policy could gain over ``round_robin``: the
    ``best_known`` plan of a case is the cheapest of the three policies and the LP's.
    """
    # datasheets: HBM3 copy ~2 TB/s on the GPU, NVLink 4 ~450 GB/s per direction per GPU,
    # NDR InfiniBand 400 Gb/s = 50 GB/s per GPU; ~20 us per collective call
    model = BandwidthModel.declared(20e-6, {"self": 2000.0, "host": 450.0, "net": 50.0})
    try:
        from conduit_dist.bench.lp_bound import best_balanced
    except ImportError:  # pragma: no cover - SciPy is in the bench and dev extras
        bound = False
    rows, gains, losses, possible, gaps = [], [], [], [], []
    for name, (topo, learners, put) in _topologies().items():
        links, world = topo.link_matrix(), topo.world
        capacity = 10_000
        requests = np.where(learners, batch, 0)
        empty = np.zeros(world)
        for sampling in ("uniform", "stratified"):
            sampler = bound_sampler(sampling, links)
            planner = BandwidthAware.bound(model, links, learners, record_bytes, sampler)
            plans = {"local": np.diag(put), "round_robin": spread(put, 0)}
            plans["bandwidth_aware"] = planner.plan(put, requests, empty, capacity)
            times = {k: planner.price(p, requests, empty, capacity) for k, p in plans.items()}
            best = min(times.values())
            rr = times["round_robin"]
            gains.append(1 - times["bandwidth_aware"] / rr)
            losses.append(times["bandwidth_aware"] / best - 1)
            row = {
                "topology": name,
                "sampling": sampling,
                **{f"{k}_ms": v * 1e3 for k, v in times.items()},
            }
            if bound:
                t_lp, support = best_balanced(
                    model, topo, learners, put, requests, record_bytes, sampling, capacity
                )
                known = min(best, t_lp)  # the LP only covers equal-inflow placements
                possible.append(1 - known / rr)
                gaps.append(times["bandwidth_aware"] / known - 1)
                row.update(lp_best_ms=t_lp * 1e3, lp_support=support)
            rows.append(row)
    out = {"rows": rows, "min_gain_vs_round_robin": min(gains), "max_loss_vs_best": max(losses)}
    if bound:
        out["best_known_gain_vs_round_robin"] = min(possible)
        out["max_loss_vs_best_known"] = max(gaps)
    return out


def main(argv: list[str]) -> None:
    """Run the parts that fit how it was launched; rank 0 prints the JSON line last."""
    p = argparse.ArgumentParser(prog="python -m conduit_dist.bench placement")
    p.add_argument(
        "--gib", type=number(float, 0), default=10.0, help="size of the disk-tier store (0 skips)"
    )
    p.add_argument("--batch", type=number(int, 1), default=256)
    p.add_argument("--fetches", type=number(int, 1), default=40)
    p.add_argument("--rounds", type=number(int, 1), default=20)
    p.add_argument(
        "--demote-items",
        type=number(int, 4),  # a quarter on the host tier: at least one item
        default=16384,
        help="store of the demotion part",
    )
    a = p.parse_args(argv)
    record_bytes = cd.ExperienceSpec.from_batch(_atari(torch.arange(1))).record_bytes
    if 0 < a.gib * 2**30 < 4 * record_bytes:  # the host tier holds a quarter of the items
        p.error(
            f"argument --gib: expected 0 (skip) or at least {4 * record_bytes / 2**30:.3g} "
            f"(4 items of {record_bytes} bytes), got {a.gib:g}"
        )
    cd.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    deliv = delivery(a.rounds, a.batch) if world > 1 else None
    disk = disk_tier(a.gib, a.batch, a.fetches) if world == 1 and a.gib > 0 else None
    demote = demotion(a.demote_items, a.batch, a.rounds, 0.02) if world == 1 else None
    if rank == 0:
        pred = predicted(record_bytes, a.batch)
        for r in pred["rows"]:
            lp = f", LP best {r['lp_best_ms']:.3f} ms" if "lp_best_ms" in r else ""
            print(
                f"{r['topology']:>24} {r['sampling']:>10}: local {r['local_ms']:.3f} ms, "
                f"round_robin {r['round_robin_ms']:.3f} ms, "
                f"bandwidth_aware {r['bandwidth_aware_ms']:.3f} ms{lp}"
            )
        if disk:
            print(
                f"disk tier: {disk['gib']:.2f} GiB ({disk['items']} items), sampling host+disk "
                f"{disk['host+disk']['sample_items_per_s']:,.0f}/s vs host "
                f"{disk['host']['sample_items_per_s']:,.0f}/s"
            )
        if deliv:
            print(f"delivery per round: {deliv}")
        if demote:
            print(
                f"full host+disk store, put+fetch per iteration: demotion inline "
                f"{demote['inline_ms']:.2f} ms, between rounds {demote['background_ms']:.2f} ms "
                f"(waited {demote['background_stats']['demotion_wait_ms']:.1f} ms in total)"
            )
        summary = {
            "stratified_delivery_cut": deliv["stratified_delivery_cut"] if deliv else None,
            "predicted_gain_vs_round_robin": pred["min_gain_vs_round_robin"],
            "max_predicted_loss_vs_best": pred["max_loss_vs_best"],
            "best_known_gain_vs_round_robin": pred.get("best_known_gain_vs_round_robin"),
            "max_predicted_loss_vs_best_known": pred.get("max_loss_vs_best_known"),
            "disk_tier_ok": disk is not None,
            "background_demotion_cut": demote["background_cut"] if demote else None,
        }
        emit("placement", pred["rows"], summary, disk=disk, delivery=deliv, demotion=demote)
    cd.destroy_distributed()


if __name__ == "__main__":
    main(__import__("sys").argv[1:])
