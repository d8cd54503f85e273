"""Placement and sampling modes on constructed topologies, and on real ranks."""

from __future__ import annotations

import numpy as np
import torch
from dist_utils import run_ranks
from plane_helpers import assert_intact, make_batch, spec

import conduit_dist as cd
from conduit_dist.collectives.topology import Topology
from conduit_dist.sampling.stratified import allocate_stratified
from conduit_dist.tiers.placement import plan_bandwidth_aware, plan_ingest

LINKS = Topology.from_hosts(["a", "a", "b", "b"]).link_matrix()
ALL = np.ones(4, dtype=bool)


def test_bandwidth_aware_keeps_balanced_items_local_and_spills_to_the_nearest():
    even = plan_bandwidth_aware(np.array([10, 10, 10, 10]), np.full(4, 100), ALL, LINKS)
    assert (even == np.diag([10, 10, 10, 10])).all()
    hot = plan_bandwidth_aware(np.array([30, 10, 0, 0]), np.full(4, 100), ALL, LINKS)
    assert hot[0, 0] == 10 and hot[1, 1] == 10  # every shard takes its fair share...
    assert hot.sum(axis=0).tolist() == [10, 10, 10, 10]  # ...and no more
    # actors on host b, the learner on host a: fair shares put half of the round on host a; with
    # delivery weighted in, host a's shards are filled from the nearest sources first
    learner = np.array([True, False, False, False])
    actors = plan_bandwidth_aware(
        np.array([0, 0, 20, 20]), np.full(4, 100), learner, LINKS, reads_per_write=4.0
    )
    assert actors[:, :2].sum() == 20 and actors[2, 0] == 10
    assert actors[2, 2] == 0  # the own shard is costlier than feeding the learner's host
    assert (plan_ingest("round_robin", np.array([10, 10, 10, 10]), 0) == 2).sum() >= 8


def test_stratified_is_proportional_and_local_first():
    gen = torch.Generator()
    eq = allocate_stratified(np.array([8, 8, 8, 8]), np.array([50, 50, 50, 50]), 0, 3, gen, LINKS)
    assert (eq == np.diag([8, 8, 8, 8])).all()  # balanced shards: everyone reads its own
    counts = allocate_stratified(
        np.array([8, 8, 8, 8]), np.array([200, 100, 50, 50]), 0, 3, gen, LINKS
    )
    assert counts.sum(axis=1).tolist() == [8, 8, 8, 8]
    assert counts.sum(axis=0).tolist() == [16, 8, 4, 4]  # proportional to shard sizes
    assert counts[2, 0] + counts[2, 1] == 4 and counts[2, 2] == 4  # own shard first


def _modes(rank, world, sampling, placement):
    plane = cd.DataPlane(
        spec(), 400, seed=5, sampling=sampling, placement=placement, schedule="sync"
    )
    crossed = []
    for it in range(4):
        plane.put(make_batch(rank * 1000 + it * 100 + torch.arange(40)))
        b = plane.fetch(32)
        assert_intact(b)
        crossed.append(int((b["id"] // 1000 != rank).sum()))
    plane.close()
    return crossed


def test_stratified_with_bandwidth_aware_reads_locally_on_real_ranks():
    local = run_ranks(_modes, 2, "stratified", "bandwidth_aware")
    spread = run_ranks(_modes, 2, "exact", "round_robin")
    assert all(sum(c) == 0 for c in local.values())  # nothing delivered across ranks
    assert all(sum(c) > 0 for c in spread.values())
