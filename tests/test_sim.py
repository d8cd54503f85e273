"""The simulator prices a round with the plane's own parts: its byte matrices come from the real
placement and allocators, and each exchange's time and strategy is what the plane's transport
would pick for the same matrix. Declared topologies load with their checks."""

from __future__ import annotations

import numpy as np
import pytest

from conduit_dist.collectives.transport import Transport
from conduit_dist.errors import ConfigError
from conduit_dist.sim import Workload, load, names, simulate

DQN = Workload("dqn", record_bytes=56, puts_per_rank=8, batch_per_learner=128, reduce_numel=17282)
ATARI = Workload(
    "atari", record_bytes=56_472, puts_per_rank=8, batch_per_learner=32, placement="round_robin",
    learner_every=8, producers="actors",
)  # fmt: skip


def test_declared_topologies_load_and_share_nics():
    assert {"dgx_h100", "frontier_mi250x", "loopback"} <= set(names())
    frontier = load("frontier_mi250x")
    assert frontier.net_gbps == pytest.approx(12.5)  # 25 GB/s NICs shared by 2 GCDs
    links = load("dgx_h100").links(16)
    assert links[0, 0] == 0 and links[0, 7] == 1 and links[0, 8] == 2  # self, NVLink, network


def test_bad_topologies_and_workloads_are_refused_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match="expected one of .*dgx_h100"):
        load("dgx_h1000")
    bad = tmp_path / "t.yaml"
    bad.write_text("ranks_per_node: 8\nlatency_us: 1\nmessage_us: 1\nself_gbps: 1\nhost_gbps: 1\n"
                   "nic_gbps: 0\n")  # fmt: skip
    with pytest.raises(ConfigError, match="nic_gbps: expected GB/s > 0, got 0"):
        load(str(bad))
    bad.write_text("ranks_per_node: 8\nlinks: 3\n")
    with pytest.raises(ConfigError, match=r"unknown keys \['links'\]"):
        load(str(bad))
    with pytest.raises(ConfigError, match="placement: expected one of"):
        Workload("x", record_bytes=8, puts_per_rank=1, batch_per_learner=1, placement="ring")


@pytest.mark.parametrize("world", [8, 16, 64])
def test_each_exchange_is_priced_as_the_planes_transport_prices_it(world):
    topo = load("dgx_h100")
    model = topo.model(world)
    r = simulate(topo, world, ATARI, model=model)
    assert r.schedule == "general"
    ops = [e.op for e in r.exchanges]
    assert ops == ["all_gather(meta)", "ingest", "deliver"]
    # the ingestion a round-robin plan moves: every actor's 8 items spread over all shards
    ingest = r.exchanges[1]
    moved = sum(ingest.bytes_by_link.values())
    actors = world - world // 8
    assert moved == actors * 8 * ATARI.record_bytes
    # the plane's transport, given the plane's round-robin plan of the same round, picks the
    # same strategy and predicts the same time
    from conduit_dist.placement import RoundRobin
    from conduit_dist.placement.base import PlacementContext
    from conduit_dist.sampling import Uniform

    learners = np.zeros(world, dtype=bool)
    learners[::8] = True
    rr = RoundRobin()
    rr.bind(PlacementContext(world, topo.links(world), learners, 56_472, model, Uniform()))
    staged = np.where(learners, 0, 8)
    sizes = np.full(world, ATARI.capacity_per_rank)
    plan = rr.plan(staged, np.where(learners, 32, 0), sizes, ATARI.capacity_per_rank)
    transport = Transport.__new__(Transport)  # its pricing only: no process group needed
    transport.model, transport.forced, transport._choices = model, "auto", {}
    transport.links = topo.links(world)
    strategy, seconds = transport.choose(plan * ATARI.record_bytes)
    assert (ingest.strategy, ingest.seconds) == (strategy, pytest.approx(seconds))
    assert r.seconds == pytest.approx(r.cpu_s + sum(e.seconds for e in r.exchanges))


def test_a_fused_round_carries_headers_candidates_and_gradients_in_one_exchange():
    topo = load("dgx_h100")
    r = simulate(topo, 8, DQN)
    assert r.schedule == "fused" and len(r.exchanges) == 1
    (ex,) = r.exchanges
    assert ex.strategy == "all_to_all"
    # every learner sends every other learner the gradients (rounded up to whole rows)
    pay = -(-17282 * 4 // 56) * 56
    assert ex.bytes_by_link["host"] >= 8 * 7 * pay
    more = simulate(topo, 8, Workload(**{**DQN.__dict__, "batch_per_learner": 1024}))
    assert more.exchanges[0].bytes_by_link["host"] > ex.bytes_by_link["host"]  # more candidates


def test_overlap_hides_up_to_the_backward_and_the_model_grows_with_scale():
    topo = load("dgx_h100")
    small = simulate(topo, 8, Workload(**{**ATARI.__dict__, "backward_ms": 50.0}))
    assert small.exposed_s == 0.0
    big = simulate(topo, 512, Workload(**{**ATARI.__dict__, "backward_ms": 0.5}))
    assert big.seconds > small.seconds and big.exposed_s == pytest.approx(big.seconds - 5e-4)
    assert big.bytes_by_link()["net"] > 0 and small.bytes_by_link()["net"] == 0
