"""Placement and sampling modes on constructed topologies, and on real ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dist_utils import run_ranks
from plane_helpers import assert_intact, make_batch, spec

import conduit_dist as cd
from conduit_dist.collectives.model import BandwidthModel
from conduit_dist.collectives.topology import Topology
from conduit_dist.placement import BandwidthAware, plan_near_learners, plan_packed, spread
from conduit_dist.registry import bound_sampler

LINKS = Topology.from_hosts(["a", "a", "b", "b"]).link_matrix()
ALL = np.ones(4, dtype=bool)


def test_near_learners_weighs_ingestion_against_delivery():
    even = plan_near_learners(np.array([10, 10, 10, 10]), np.full(4, 100), ALL, LINKS)
    assert (even == np.diag([10, 10, 10, 10])).all()  # colocated: everything stays local
    # a shard takes at most its capacity per round; the rest goes to the nearest shard
    hot = plan_near_learners(np.array([30, 0, 0, 0]), np.full(4, 12), ALL, LINKS)
    assert hot[0].tolist() == [12, 12, 3, 3]  # equally far shards share the overflow
    # actors on host b, the learner on host a
    learner = np.array([True, False, False, False])
    put = np.array([0, 0, 20, 20])
    low = plan_near_learners(put, np.full(4, 100), learner, LINKS, reads_per_write=0.2)
    assert (low == np.diag(put)).all()  # few reads per write: items stay with their actors
    high = plan_near_learners(put, np.full(4, 100), learner, LINKS, reads_per_write=8.0)
    assert high[:, 0].sum() == 40  # many reads per write: they move next to the learner
    assert (spread(np.array([10, 10, 10, 10]), 0) == 2).sum() >= 8


# datasheet-like numbers: a fast host link, a slow network
MODEL = BandwidthModel.declared(20e-6, {"self": 2000.0, "host": 450.0, "net": 50.0})
TOPO8 = Topology.from_hosts([f"n{i // 4}" for i in range(8)]).link_matrix()


def _planner(links, learners, sampling, rb=28_240):
    return BandwidthAware.bound(MODEL, links, learners, rb, bound_sampler(sampling, links))


@pytest.mark.parametrize("sampling", ["uniform", "stratified"])
def test_bandwidth_aware_picks_the_plan_the_model_prices_cheapest(sampling):
    cap = 10_000
    learner = np.zeros(8, bool)
    learner[:4] = True  # host n0 learns, host n1 acts
    cases = {
        "colocated": (np.ones(8, bool), np.full(8, 64), np.full(8, 256)),
        "actors, high replay": (learner, np.where(learner, 0, 64), np.where(learner, 2048, 0)),
        "actors, low replay": (learner, np.where(learner, 0, 64), np.where(learner, 8, 0)),
        "skewed producers": (
            np.ones(8, bool),
            np.array([320, 0, 0, 0, 16, 16, 16, 16]),
            np.full(8, 64),
        ),
    }
    picks = {}
    for name, (learners, put, requests) in cases.items():
        planner = _planner(TOPO8, learners, sampling)
        plan = planner.plan(put, requests, np.zeros(8), cap)
        prices = {
            "local": planner.price(np.diag(put), requests, np.zeros(8), cap),
            "round_robin": planner.price(spread(put, 0), requests, np.zeros(8), cap),
        }
        chosen = planner.price(plan, requests, np.zeros(8), cap)
        assert chosen <= min(prices.values()) + 1e-12, (name, chosen, prices)
        assert plan.sum(axis=1).tolist() == put.tolist()  # every staged item placed once
        picks[name] = min(planner.last, key=planner.last.get)
        if name == "actors, high replay":  # read many times: move them once, next to the learners
            assert plan[:, learners].sum() == put.sum(), plan
            assert ((plan > 0).sum(axis=1) <= 1).all(), plan  # each actor feeds one learner
    assert picks["colocated"] == "local"  # nothing to gain by moving items
    assert picks["actors, low replay"] == "local"  # read rarely: leave them with the actors


def test_lp_reference_never_prices_above_round_robin_and_finds_near_learners():
    """The bench's LP reference: round_robin is one of its equal-inflow placements, so its best
    is never dearer; with a high replay ratio the best support is the learners' host alone."""
    pytest.importorskip("scipy")
    from conduit_dist.bench.lp_bound import best_balanced

    topo = Topology.from_hosts(["n0"] * 4 + ["n1"] * 4)
    learner = np.zeros(8, bool)
    learner[:4] = True
    put, requests = np.where(learner, 0, 64), np.where(learner, 2048, 0)
    cap = 10_000
    planner = _planner(topo.link_matrix(), learner, "uniform")
    rr = planner.price(spread(put, 0), requests, np.zeros(8), cap)
    t, support = best_balanced(MODEL, topo, learner, put, requests, 28_240, "uniform")
    assert t <= rr * (1 + 1e-9)
    assert support == {"learner/4/0": 4, "actor/4/64": 0}
    near = planner.price(planner.plan(put, requests, np.zeros(8), cap), requests, np.zeros(8), cap)
    assert near <= t * (1 + 1e-9) and near < rr  # the planner's packed plans find it too


def test_packed_plans_store_equal_shares_nearest_first_in_few_messages():
    put = np.array([0, 0, 30, 10, 20, 20, 0, 0])
    stores = np.array([False, False, True, False, True, False, False, True])
    plan = plan_packed(put, stores, TOPO8)  # hosts n0 = ranks 0-3, n1 = ranks 4-7
    assert plan.sum(axis=1).tolist() == put.tolist()  # every staged item placed once
    assert plan.sum(axis=0).tolist() == [0, 0, 27, 0, 27, 0, 0, 26]  # equal shares
    assert plan[2, 2] == 27 and plan[4, 4] == 20  # a storing source keeps its own first
    assert plan[5, 4] == 7 and plan[5, 7] == 13  # then within the host, filling in rank order
    assert plan[2, 7] == 3 and plan[3, 7] == 10  # then between hosts: what n0 could not keep
    assert ((plan > 0).sum(axis=1) <= 2).all()  # a source spills into a second shard at most
    with pytest.raises(ValueError, match="stores"):
        plan_packed(put, np.zeros(8, bool), TOPO8)


def test_packed_candidates_are_named_by_family_and_ranks_per_host():
    learner = np.zeros(8, bool)
    learner[:4] = True
    planner = _planner(TOPO8, learner, "uniform")
    put = np.where(learner, 0, 64)
    names = planner.names(put, 10_000)
    assert names[:3] == list(BandwidthAware.CANDIDATES)
    assert names[3:] == [f"learners/{k}" for k in range(1, 5)] + [
        f"producers/{k}" for k in range(1, 5)
    ]
    assert planner.candidate("producers/1", put, put, 10_000)[:, 4].sum() == put.sum()
    assert "learners/1" not in planner.names(put, 100)  # 256 items a round: over capacity
    with pytest.raises(ValueError, match="got 'packed'"):
        planner.candidate("packed", put, put, 10_000)


@pytest.mark.parametrize("sampling", ["uniform", "stratified"])
def test_bandwidth_aware_prices_within_5_percent_of_the_lp_on_disaggregated_nodes(sampling):
    """8 nodes of 4 ranks, node 0 learns, the others act: with per-message costs storing on
    fewer shards pays, and the planner's packed candidates find a plan as cheap as the LP's."""
    pytest.importorskip("scipy")
    from conduit_dist.bench.lp_bound import best_balanced

    topo = Topology.from_hosts([f"n{i // 4}" for i in range(32)])
    learner = np.zeros(32, bool)
    learner[:4] = True
    put, requests, cap = np.where(learner, 0, 64), np.where(learner, 256, 0), 10_000
    planner = _planner(topo.link_matrix(), learner, sampling)
    plan = planner.plan(put, requests, np.zeros(32), cap)
    chosen = planner.price(plan, requests, np.zeros(32), cap)
    t, _ = best_balanced(MODEL, topo, learner, put, requests, 28_240, sampling, cap)
    assert chosen <= t * 1.05, (chosen, t, min(planner.last, key=planner.last.get))
    assert chosen < planner.last["local"] * 0.9  # local alone was up to 1.7x the LP here
    assert plan.sum(axis=1).tolist() == put.tolist()
    fed = plan.sum(axis=0)[plan.sum(axis=0) > 0]
    assert fed.max() - fed.min() <= 1  # the shards it feeds stay equally fresh


def test_stratified_is_proportional_and_local_first():
    sampler, none = bound_sampler("stratified", LINKS), np.zeros((4, 0))
    eq = sampler.allocate(np.array([8, 8, 8, 8]), np.array([50, 50, 50, 50]), 3, none)
    assert (eq == np.diag([8, 8, 8, 8])).all()  # balanced shards: everyone reads its own
    counts = sampler.allocate(np.array([8, 8, 8, 8]), np.array([200, 100, 50, 50]), 3, none)
    assert counts.sum(axis=1).tolist() == [8, 8, 8, 8]
    assert counts.sum(axis=0).tolist() == [16, 8, 4, 4]  # proportional to shard sizes
    assert counts[2, 0] + counts[2, 1] == 4 and counts[2, 2] == 4  # own shard first


def _modes(rank, world, sampling, placement):
    plane = cd.DataPlane(
        spec(), 400, seed=5, sampler=sampling, placement=placement, schedule="sync"
    )
    crossed, exchanges = [], []
    for it in range(4):
        plane.put(make_batch(rank * 1000 + it * 100 + torch.arange(40)))
        b = plane.fetch(32)
        assert_intact(b)
        crossed.append(int((b["id"] // 1000 != rank).sum()))
        exchanges.append(sorted(m.op for m in plane.stats.moves))
    plane.close()
    return crossed, exchanges


def test_stratified_with_bandwidth_aware_reads_locally_on_real_ranks():
    local = run_ranks(_modes, 2, "stratified", "bandwidth_aware")
    spread = run_ranks(_modes, 2, "uniform", "round_robin")
    assert all(sum(c) == 0 for c, _ in local.values())  # nothing delivered across ranks
    # items kept and read where they were put: neither ingestion nor delivery runs a collective
    assert all(ex == [[]] * 4 for _, ex in local.values())
    assert all(sum(c) > 0 for c, _ in spread.values())
    assert all(ex == [["deliver", "ingest"]] * 4 for _, ex in spread.values())
