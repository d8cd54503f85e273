"""The simulator prices a round with the plane's own parts: its byte matrices come from the real
placement and allocators, and each exchange's time and strategy is what the plane's transport
would pick for the same matrix. Declared topologies load with their checks."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from conduit_dist.bench.sim_validate import (
    Config,
    Run,
    fit_bookkeeping,
    increments,
    pool_bookkeeping,
    score,
    sources,
    summarize,
)
from conduit_dist.collectives.transport import Transport
from conduit_dist.errors import ConfigError
from conduit_dist.sim import TokenWorkload, Workload, load, names, simulate, simulate_tokens
from conduit_dist.tokens import balance
from conduit_dist.tokens.wire import Wire

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
    assert ops == ["all_gather(meta)", "ingest", "deliver", "read(device)"]
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
    assert r.schedule == "fused" and [e.op for e in r.exchanges] == [
        "all_to_all(round)",
        "read(device)",
    ]
    ex = r.exchanges[0]
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


def test_tiers_read_at_their_declared_speed_and_a_host_tier_crosses_to_the_device():
    topo = load("dgx_h100")
    pinned = simulate(topo, 16, Workload(**{**ATARI.__dict__, "tier": "pinned"}))
    ops = {e.op: e for e in pinned.exchanges}
    assert "read(pinned)" in ops and "h2d(batch)" in ops
    # a learner's batch of 32 Atari frames over PCIe, and the busiest shard's reads from DRAM
    assert ops["h2d(batch)"].seconds == pytest.approx(32 * 56_472 / (topo.h2d_gbps * 1e9))
    read_gbps = topo.tier_gbps["pinned"][0]
    assert ops["read(pinned)"].seconds * read_gbps * 1e9 >= 32 * 56_472 / 16 * 0.99
    device = simulate(topo, 16, ATARI)
    assert "h2d(batch)" not in {e.op for e in device.exchanges}
    assert device.seconds < pinned.seconds
    with pytest.raises(ConfigError, match="tier: expected one of"):
        Workload("x", record_bytes=8, puts_per_rank=1, batch_per_learner=1, tier="nvme")


def test_a_topology_without_a_tier_refuses_it_and_bad_tier_numbers_are_named(tmp_path):
    bad = tmp_path / "t.yaml"
    base = (
        "ranks_per_node: 8\nlatency_us: 1\nmessage_us: 1\nself_gbps: 1\nhost_gbps: 1\nnic_gbps: 1\n"
    )
    bad.write_text(base + "tier_gbps:\n  pinned: [10.0]\n")
    with pytest.raises(ConfigError, match=r"tier_gbps\['pinned'\]: expected .* \[read, write\]"):
        load(str(bad))
    bad.write_text(base + "tier_gbps:\n  device: [100.0, 100.0]\n")
    with pytest.raises(ConfigError, match="tier 'disk': topology 't' declares tier_gbps for"):
        simulate(load(str(bad)), 8, Workload(**{**ATARI.__dict__, "tier": "disk"}))


def test_oversubscribed_nodes_stretch_the_bookkeeping_only():
    topo = load("dgx_h100")
    busy = type(topo)(**{**topo.__dict__, "cores_per_node": 4})  # 8 ranks on 4 cores
    a, b = simulate(topo, 8, DQN), simulate(busy, 8, DQN)
    assert b.cpu_s == pytest.approx(2 * a.cpu_s)
    assert [e.seconds for e in a.exchanges] == [e.seconds for e in b.exchanges]
    assert busy.oversubscription(2) == 1.0  # 2 ranks fit 4 cores


def test_bookkeeping_is_fitted_from_a_rounds_run_as_each_case_over_its_raw_collectives():
    run = {"results": [
        {"case": "fused", "round_ms": 1.0, "raw_ms": 0.4},
        {"case": "fused_grads", "round_ms": 1.4, "raw_ms": 0.5},
        {"case": "three_exchange", "round_ms": 3.0, "raw_ms": 1.2},
    ]}  # fmt: skip
    fit = fit_bookkeeping(run)
    assert fit["round_cpu_us"] == pytest.approx(600.0)
    assert fit["exchange_cpu_us"] == pytest.approx(600.0)  # (1800 - 600) / 2 further exchanges
    # the gradients' extra 300 us for 17,282 floats
    assert fit["payload_gbps"] == pytest.approx(17_282 * 4 / 300e3)
    with pytest.raises(ConfigError, match=r"missing \['three_exchange'\]"):
        fit_bookkeeping({"results": run["results"][:2]})
    topo = type(load("dgx_h100"))(**{**load("dgx_h100").__dict__, **fit})
    r = simulate(topo, 8, DQN)
    assert r.cpu_s == pytest.approx(600e-6 + 300e-6)


def _rounds(fused_us: float, grads_us: float, three_us: float) -> dict:
    """A ``bench rounds`` run whose cases take these microseconds over their raw collectives."""
    extra = {"fused": fused_us, "fused_grads": grads_us, "three_exchange": three_us}
    results = [{"case": c, "round_ms": 0.5 + us / 1e3, "raw_ms": 0.5} for c, us in extra.items()]
    return {"world": 2, "results": results}


def test_the_pooled_fit_is_each_terms_median_so_one_slow_case_moves_nothing():
    # four fitting runs: the gradients cost 0-100 us over the fused round, but one run's
    # gradients case was slow (1,900 us over: a moment of the machine, not the payload)
    runs = [_rounds(400, 450, 1000), _rounds(380, 480, 900), _rounds(420, 2320, 1020),
            _rounds(400, 400, 1100)]  # fmt: skip
    inc = [increments(r) for r in runs]
    assert inc[2]["payload_us"] == pytest.approx(1900)
    pooled = pool_bookkeeping(inc)
    assert pooled["round_cpu_us"] == pytest.approx(400)  # median of 380, 400, 400, 420
    assert pooled["exchange_cpu_us"] == pytest.approx(300)  # median of 260, 300, 300, 350
    # the median payload: 50 and 100 us between them, 75 us; the slow run alone: 1,900 us
    assert pooled["payload_gbps"] == pytest.approx(17_282 * 4 / 75e3)
    assert fit_bookkeeping(runs[2])["payload_gbps"] == pytest.approx(17_282 * 4 / 1900e3)
    # a payload that costs nothing within the noise (the median increment <= 0) is free,
    # though one run alone would price it
    free = pool_bookkeeping([increments(_rounds(400, g, 1000)) for g in (380, 390, 450)])
    assert free["payload_gbps"] == 0.0
    with pytest.raises(ConfigError, match="at least one run"):
        pool_bookkeeping([])


LOOP2, LOOP3 = Config(1, 2), Config(1, 3)
FAST, SLOW, BUSY = Config(2, 1, 2000.0), Config(2, 1, 500.0), Config(2, 2, 2000.0)


def _run(cfg: Config, job: int, tmp_path, round_us: float, gbps: float = 1.0) -> Run:
    """A measured run of fake timings, its calibration a declared model (``gbps`` on every
    link) saved where the plane's cache would hold it."""
    from conduit_dist.collectives.model import BandwidthModel
    from conduit_dist.collectives.model.cache import cache_path, save_cache
    from conduit_dist.collectives.topology import Topology

    keys = None
    hosts = [f"node0@{socket.gethostname()}"] * cfg.world
    if cfg.hosts > 1:
        keys = tuple(
            f"node{i}@host{i}" for i in range(cfg.hosts) for _ in range(cfg.ranks_per_host)
        )
        hosts = list(keys)
    cache = str(tmp_path / f"{cfg.label}-{job}")
    model = BandwidthModel.declared(100e-6, dict.fromkeys(("self", "host", "net"), gbps))
    save_cache(cache_path(cache, "gloo", Topology.from_hosts(hosts)), model, "gloo",
               Topology.from_hosts(hosts))  # fmt: skip
    cases = {"fused": 1, "fused_grads": 1.5, "three_exchange": 3}
    results = [
        {"case": c, "round_ms": 0.3 * k + round_us * k / 1e3, "raw_ms": 0.3 * k,
         "exposed_ms": 0.5 if c != "three_exchange" else None}
        for c, k in cases.items()
    ]  # fmt: skip
    measured = {"world": cfg.world, "put": 8, "batch": 128, "results": results}
    return Run(cfg, job, measured, cache, keys)


def test_every_scored_run_is_predicted_from_other_runs_and_oversubscribed_ones_not_scored(
    tmp_path,
):
    runs = [
        _run(c, j, tmp_path, 400 + 10 * i)
        for i, (j, c) in enumerate([(j, c) for j in (0, 1) for c in (LOOP2, FAST, SLOW)])
    ]
    runs += [_run(LOOP3, 0, tmp_path, 900), _run(BUSY, 0, tmp_path, 900)]
    got = sources(runs, cores=2)
    scored = runs[:6]
    for r, (calib, pool) in got.items():
        if r.config in (LOOP3, BUSY):  # more ranks than cores: own calibration, scored fits
            assert calib is r and pool == tuple(scored)
            continue
        # another job of the same layout calibrated; every run of the other layouts is pooled
        assert calib is not r and calib.config == r.config and calib.job != r.job
        assert pool == tuple(o for o in scored if o.config != r.config) and len(pool) == 4
    with pytest.raises(ConfigError, match=r"scored configurations \['loopback, 2 ranks'\]"):
        sources(runs[:1], cores=2)
    # a single scored layout: the fit comes from its other job, as the calibration does
    alone = [_run(LOOP2, j, tmp_path, 400) for j in (0, 1)]
    assert sources(alone, cores=2)[alone[0]] == (alone[1], (alone[1],))


def test_checks_name_their_sources_and_only_scored_ones_are_summarized(tmp_path):
    loops = [_run(LOOP2, j, tmp_path, 400, gbps=1.0 + j) for j in (0, 1)]
    hosts = [_run(FAST, j, tmp_path, 800) for j in (0, 1)]
    busy = _run(BUSY, 0, tmp_path, 900)
    checks, fits = score([*loops, *hosts, busy], load("loopback"), cores=2)
    assert fits["loopback, 2 ranks, job 0"]["round_cpu_us"] == pytest.approx(400)
    mine = [c for c in checks if c["where"] == "loopback, 2 ranks" and c["job"] == 0]
    assert {c["calibration_source"] for c in mine} == {"loopback, 2 ranks, job 1"}
    assert all(
        c["fit_sources"] == [f"2 hosts x 1 rank, 2000 Mbit/s, job {j}" for j in (0, 1)]
        for c in mine
    )
    fused = next(c for c in mine if c["case"] == "fused" and c["metric"] == "round")
    # the bookkeeping predicted is the other layout's (800 us), not this run's own (400 us)
    assert fused["bookkeeping_predicted_ms"] == pytest.approx(0.8)
    assert fused["error_in_sample"] != fused["error"]
    # and its collectives are priced with job 1's calibration (twice job 0's GB/s): faster
    other = next(
        c for c in checks if c["where"] == "loopback, 2 ranks" and c["job"] == 1
        and c["case"] == "fused_grads" and c["metric"] == "round"
    )  # fmt: skip
    grads = next(c for c in mine if c["case"] == "fused_grads" and c["metric"] == "round")
    assert grads["collectives_ms"] < other["collectives_ms"]
    over = [c for c in checks if not c["scored"]]
    assert over and {c["where"] for c in over} == {"2 hosts x 2 ranks, 2000 Mbit/s"}
    assert all(c["calibration_source"].endswith("(own run: in sample)") for c in over)
    assert all("error_in_sample" not in c for c in over)
    s = summarize(checks)
    scored = [abs(c["error"]) for c in checks if c["scored"]]
    assert s["worst_error_out_of_sample"] == max(scored) and s["scored_checks"] == len(scored)
    assert s["scored_set"] == ["loopback, 2 ranks", "2 hosts x 1 rank, 2000 Mbit/s"]
    assert s["oversubscribed_set"] == ["2 hosts x 2 ranks, 2000 Mbit/s"]
    assert s["worst_error_oversubscribed"] == max(abs(c["error"]) for c in over)


LLM = TokenWorkload("llm", params_b=1.0, groups_per_learner=3, group_size=4, step_ms=500.0)


@pytest.mark.parametrize("world", [4, 16])
def test_a_token_round_delivers_the_planners_balanced_groups_and_sends_the_weights(world):
    topo = load("dgx_h100")
    r = simulate_tokens(topo, world, LLM, seed=1)
    assert r.schedule == "tokens"
    ops = {e.op: e for e in r.exchanges}
    assert list(ops) == ["all_gather(meta)", "send(weights)", "deliver(tokens)"]
    # as the plane sends them: each learner's part (bf16) to each generator, the whole
    # version once to each of the world / 2 generators, no learner sending more than its part
    assert sum(ops["send(weights)"].bytes_by_link.values()) == world // 2 * 2_000_000_000
    # the token bytes: each learner's groups, as the token plane's planner shares them out,
    # sized by its wire layout (the sequences stay with their generators: no self bytes)
    learners = world // 2
    rng = np.random.default_rng(1)
    n_groups = 3 * learners
    lengths = rng.lognormal(np.log(600), 0.8, (n_groups, 4)).astype(np.int64)
    tokens = np.clip(lengths, 1, 8192).sum(axis=1)
    plan = balance.plan(tokens, learners, LLM.token_budget)
    assert balance.imbalance(tokens, [[i for mb in p for i in mb] for p in plan]) < 1.5
    moved = sum(ops["deliver(tokens)"].bytes_by_link.values())
    wire = Wire(LLM.spec())
    lower = wire.nbytes(n_groups * 4, int(tokens.sum()))  # one section holding everything
    assert lower <= moved <= lower + 64 * n_groups * 8  # plus per-section column padding
    assert r.exposed_s == max(0.0, r.seconds - 0.5)


def test_a_token_world_needs_a_generator():
    with pytest.raises(ConfigError, match="no generator at world 1"):
        simulate_tokens(load("dgx_h100"), 1, TokenWorkload("x", 1.0, learner_every=1))
    with pytest.raises(ConfigError, match="group_size: expected >= 1, got 0"):
        TokenWorkload("x", 1.0, group_size=0)


def test_what_hides_depends_on_how_the_round_overlaps():
    topo = load("dgx_h100")
    rounds = {
        o: simulate(topo, 64, Workload(**{**DQN.__dict__, "backward_ms": 0.1, "overlap": o}))
        for o in ("thread", "flight", "none")
    }
    t, f, n = rounds["thread"], rounds["flight"], rounds["none"]
    assert t.seconds == f.seconds == n.seconds > 1e-4  # the same round, hidden differently
    assert n.exposed_s == n.seconds
    assert t.exposed_s == pytest.approx(t.seconds - 1e-4)  # the worker thread hides it all
    # early start hides the exchange only: more is exposed than with the worker thread, and
    # at least the host's work (bookkeeping, the shard's reads)
    reads = sum(e.seconds for e in f.exchanges if e.op.startswith("read("))
    assert t.exposed_s < f.exposed_s < n.exposed_s and f.exposed_s >= f.cpu_s + reads > 0
    long = simulate(topo, 8, Workload(**{**DQN.__dict__, "backward_ms": 50.0, "overlap": "flight"}))
    reads = sum(e.seconds for e in long.exchanges if e.op.startswith("read("))
    assert long.exposed_s == pytest.approx(long.cpu_s + reads)  # the exchange fully hidden
    with pytest.raises(ConfigError, match="overlap: expected one of"):
        Workload("x", record_bytes=8, puts_per_rank=1, batch_per_learner=1, overlap="async")


def test_the_examples_in_docs_sim_run_as_written():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "sim.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    assert len(blocks) >= 2
    for block in blocks:
        exec(compile(block, "docs/sim.md", "exec"), {})  # the docs' own examples
