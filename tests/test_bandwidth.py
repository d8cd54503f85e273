"""Bandwidth model: fit, choice, strategies byte-identical on real ranks, calibration cache."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from dist_utils import run_ranks

from conduit_dist.collectives.model import (
    CACHE_VERSION,
    FEATURES,
    TIE_MARGIN,
    BandwidthModel,
    cache_path,
    features,
    fit,
    load_cache,
    probe_matrices,
    save_cache,
)
from conduit_dist.collectives.strategies import NAMES
from conduit_dist.collectives.topology import Topology
from conduit_dist.errors import ConfigError


def test_fit_recovers_latency_and_bandwidth_from_synthetic_timings():
    rng = np.random.default_rng(0)
    alpha, inv_host, inv_self = 120e-6, 1 / 1.6e9, 1 / 9e9
    links = Topology.single_host(2).link_matrix()
    samples = []
    for size in [1e3, 1e4, 1e5, 1e6, 1e7, 5e7]:
        # the probe's patterns: one hot destination tells one-way from both-ways bytes apart
        for m in probe_matrices(2, size).values():
            x = features("all_to_all", m, links)
            t = x @ np.array([alpha, inv_self, inv_host, inv_host, 0.0, 0.0, 0.0])
            t *= rng.uniform(0.97, 1.03)
            samples.append((x, t))
    coef = fit(samples)
    assert coef[0] == pytest.approx(alpha, rel=0.1)
    assert coef[2] == pytest.approx(inv_host, rel=0.1)
    assert coef[3] == pytest.approx(inv_host, rel=0.1)  # loopback: both directions cost
    assert coef[4] == coef[5] == 0.0  # no cross-host bytes on one host: nothing to fit
    # at one world size the all-to-all's messages are a constant, like its call: the call
    # carries their cost
    assert coef[FEATURES.index("msgs")] == 0.0


def _tbf_probe(burst: float, rng) -> dict[str, list[tuple[np.ndarray, float]]]:
    """The calibration's probe on 2 hosts of 1 rank joined by a token-bucket link: 100 us a
    call, 1 GB/s within a rested ``burst`` (0: an unshaped link), 62.5 MB/s (500 Mbit/s)
    beyond it, 3% noise."""
    from conduit_dist.collectives.model import PROBE_SIZES

    links = Topology.from_hosts(["a", "b"]).link_matrix()
    samples: dict[str, list[tuple[np.ndarray, float]]] = {"all_to_all": [], "p2p": []}
    for size in PROBE_SIZES:
        for m in probe_matrices(2, size).values():
            for name, got in samples.items():
                x = features(name, m, links)
                net = x[FEATURES.index("bytes_net")]
                t = 100e-6 * x[0] + x[1] / 9e9 + min(net, burst) / 1e9
                t += max(0.0, net - burst) / (62.5e6 if burst else 1e9)
                got.append((x, t * rng.uniform(0.97, 1.03)))
    return samples


def test_a_shaped_links_burst_is_fitted_as_a_knee_and_prices_a_rounds_payload_at_line_rate():
    from conduit_dist.collectives.model.costs import fit_burst

    rng = np.random.default_rng(0)
    links = Topology.from_hosts(["a", "b"]).link_matrix()
    payload = np.array([[0, 70_000], [70_000, 0]])  # a round's gradients, within the burst
    bulk = np.array([[0, 4 << 20], [4 << 20, 0]])  # 4 MiB, far beyond it
    truth = {"payload": 100e-6 + 70_000 / 1e9, "bulk": 100e-6 + (256 << 10) / 1e9
             + ((4 << 20) - (256 << 10)) / 62.5e6}  # fmt: skip
    samples = _tbf_probe(256 << 10, rng)
    coef, burst, over = fit_burst(samples)
    assert burst == {"all_to_all": 256 << 10, "p2p": 256 << 10} and set(over) == set(burst)
    knee = BandwidthModel(coef, "calibrated", burst, over)
    assert knee.predict("all_to_all", payload, links) == pytest.approx(truth["payload"], rel=0.1)
    assert knee.predict("all_to_all", bulk, links) == pytest.approx(truth["bulk"], rel=0.1)
    assert knee.terms("all_to_all", bulk, links)["bytes_net_over_burst"] > 0
    assert "256 KiB burst" in knee.describe()
    # one rate for every size (the model without a knee) cannot price both: fitted on relative
    # error it keeps the small probes' line rate and prices the bulk ~12x too cheap
    plain = BandwidthModel({n: fit(s) for n, s in samples.items()}, "calibrated")
    assert plain.predict("all_to_all", bulk, links) < truth["bulk"] / 2
    # an unshaped link shows no knee: none is kept
    coef, burst, over = fit_burst(_tbf_probe(0.0, rng))
    assert burst == {} and over == {}
    with pytest.raises(ConfigError, match="knee"):
        BandwidthModel(coef, "given", {"p2p": -1.0}, {"p2p": 1e-9})


def test_features_encode_the_algorithmic_factors():
    topo = Topology.from_hosts(["a", "a", "b", "b"])
    links = topo.link_matrix()
    m = np.zeros((4, 4))
    m[0, 1], m[0, 2], m[3, 0] = 100, 50, 7
    x = dict(zip(FEATURES, features("all_to_all", m, links)))
    # rank 0 sends 100 within its host, and over the network sends 50 while receiving 7
    assert x["calls"] == 1 and x["bytes_host"] == 100 and x["both_host"] == 0
    assert x["bytes_net"] == 50 and x["both_net"] == 7
    m2 = m.copy()
    m2[1, 0] = 30  # now rank 0 also receives 30 within its host: 30 bytes move both ways
    x2 = dict(zip(FEATURES, features("all_to_all", m2, links)))
    assert x2["bytes_host"] == 100 and x2["both_host"] == 30
    assert x["msgs"] == 6  # the fused all-to-all sends to and receives from every peer
    p2p = dict(zip(FEATURES, features("p2p", m, links)))
    assert p2p["calls"] == p2p["msgs"] == 3  # rank 0 sends to 2 peers and receives from 1
    assert dict(zip(FEATURES, features("chunked4", m, links)))["calls"] == 12
    g = dict(zip(FEATURES, features("gather", m, links)))
    assert g["calls"] == 3  # three destinations receive
    assert g["msgs"] == 3 + 2  # rank 0 roots one gather (3 chunks in) and sends to 2 others
    assert g["bytes_net"] == 4 * 100 + 4 * 50 + 4 * 7  # padded to the largest chunk, world each


def _reference_features(strategy, m, links):
    """The features by their definition, pair by pair (the vectorised ones must equal it)."""
    w = m.shape[0]
    x = dict.fromkeys(FEATURES, 0.0)
    if strategy == "gather":
        dests = [d for d in range(w) if m[:, d].sum() > 0]
        x["calls"] = len(dests)
        for d in dests:
            x["bytes_self"] += m[d, d]
            net = any(links[s, d] == 2 for s in range(w))
            x["bytes_net" if net else "bytes_host"] += w * m[:, d].max()
        x["msgs"] = max(
            ((w - 1) if r in dests else 0) + len(dests) - (r in dests) for r in range(w)
        )
        return np.array([x[f] for f in FEATURES])
    for c, link in ((1, "host"), (2, "net")):
        out = [sum(m[r, d] for d in range(w) if links[r, d] == c) for r in range(w)]
        into = [sum(m[s, r] for s in range(w) if links[s, r] == c) for r in range(w)]
        x[f"bytes_{link}"] = max(max(o, i) for o, i in zip(out, into))
        x[f"both_{link}"] = max(min(o, i) for o, i in zip(out, into))
    x["bytes_self"] = max(m[r, r] for r in range(w))
    if strategy == "all_to_all":
        x["calls"], x["msgs"] = 1, 2 * (w - 1)
    else:
        nz = [
            (m[r] > 0).sum() - (m[r, r] > 0) + (m[:, r] > 0).sum() - (m[r, r] > 0) for r in range(w)
        ]
        x["calls"] = x["msgs"] = max(nz) * (4 if strategy.startswith("chunked") else 1)
    return np.array([x[f] for f in FEATURES])


def test_vectorised_features_equal_their_pair_by_pair_definition():
    rng = np.random.default_rng(3)
    for _ in range(200):
        w = int(rng.integers(1, 9))
        links = Topology.from_hosts([f"h{rng.integers(0, 3)}" for _ in range(w)]).link_matrix()
        m = rng.integers(0, 1000, (w, w)) * (rng.random((w, w)) < 0.5)
        for strategy in ("all_to_all", "p2p", "chunked4", "gather"):
            got, want = features(strategy, m, links), _reference_features(strategy, m, links)
            assert np.array_equal(got, want), (strategy, m, links, got, want)


def test_choose_returns_the_argmin_of_the_model():
    links = Topology.single_host(3).link_matrix()
    cheap_calls = np.array([1e-3, 0, 1e-9, 1e-9, 0, 0, 0])
    cheap_bytes = np.array([1e-2, 0, 1e-11, 1e-11, 0, 0, 0])
    model = BandwidthModel(
        {
            "all_to_all": cheap_calls,
            "p2p": cheap_bytes,
            "chunked4": cheap_bytes * 2,
            "gather": cheap_calls * 3,
        }
    )
    small = np.full((3, 3), 10)
    big = np.full((3, 3), 10**9)
    for m in (small, big):
        name, t = model.choose(m, links, margin=0.0)
        preds = {n: model.predict(n, m, links) for n in model.coef}
        assert name == min(preds, key=preds.get) and t == min(preds.values())
    assert model.choose(small, links)[0] == "all_to_all"
    assert model.choose(big, links)[0] == "p2p"
    # a predicted gain within the tie margin keeps the fused all-to-all
    close = BandwidthModel(
        {
            "all_to_all": np.array([1.0, 0, 0, 0, 0, 0, 0]),
            "p2p": np.array([0.45, 0, 0, 0, 0, 0, 0]),
        }
    )
    one = np.array([[0, 1], [0, 0]])
    two = Topology.single_host(2).link_matrix()
    assert close.choose(one, two, margin=0.15)[0] == "p2p"  # 1 message: 0.45 vs 1.0
    assert close.choose(np.array([[0, 1], [1, 0]]), two, margin=0.15)[0] == "all_to_all"  # 0.9


# datasheet-like numbers (HBM copy, NVLink, InfiniBand; ~20 us per call), and this machine's
# declared defaults (2 loopback gloo ranks)
DATACENTER = (20e-6, {"self": 2000.0, "host": 450.0, "net": 50.0})
LOOPBACK = (1.5e-4, {"self": 8.0, "host": 1.5, "net": 0.1})


def test_declared_numbers_tell_the_strategies_apart():
    model = BandwidthModel.declared(*DATACENTER)
    links = Topology.from_hosts([f"n{i // 4}" for i in range(16)]).link_matrix()  # 4 hosts x 4
    world = 16
    big = np.full((world, world), 4 << 20)  # 4 MiB to every peer
    ring = np.zeros((world, world), dtype=np.int64)
    ring[np.arange(world), (np.arange(world) + 1) % world] = 512  # each rank: 512 B to the next
    uneven = np.zeros((world, world), dtype=np.int64)
    uneven[[0, 3, 5, 9], [7, 12, 1, 14]] = [300, 2000, 64, 900]  # a few small sends
    hot = np.zeros((world, world), dtype=np.int64)
    hot[:, 0] = 1024  # every rank sends 1 KiB to one learner
    picks = {
        n: model.choose(m, links)[0]
        for n, m in [("big", big), ("ring", ring), ("uneven", uneven), ("hot", hot)]
    }
    # dense and large: one fused call; sparse and small: only the messages that carry bytes;
    # one hot destination of small chunks: one gather instead of a call per sender
    assert picks == {"big": "all_to_all", "ring": "p2p", "uneven": "p2p", "hot": "gather"}
    # by the model's own account each pick beats the fused all-to-all by more than the margin
    for name, m in [("ring", ring), ("uneven", uneven), ("hot", hot)]:
        ratio = model.predict(picks[name], m, links) / model.predict("all_to_all", m, links)
        assert ratio < 1 - TIE_MARGIN, (name, ratio)
    # large one-hot chunks: bytes dominate, gather's padding loses, the fused call stays
    assert model.choose(hot * 4096, links)[0] == "all_to_all"
    # the library's default numbers on 2 loopback ranks: one-way traffic of small rows goes
    # point-to-point (the fused call would also send an empty message back), both ways stays fused
    two = Topology.single_host(2).link_matrix()
    default = BandwidthModel.declared(*LOOPBACK)
    assert default.choose(np.array([[0, 4096], [0, 0]]), two)[0] == "p2p"
    assert default.choose(np.array([[0, 4096], [4096, 0]]), two)[0] == "all_to_all"
    assert default.choose(np.full((2, 2), 8 << 20), two)[0] == "all_to_all"


def test_declared_numbers_are_checked_and_models_say_where_they_came_from():
    with pytest.raises(ConfigError, match="missing \\['net'\\]"):
        BandwidthModel.declared(1e-4, {"self": 8.0, "host": 1.5})
    with pytest.raises(ConfigError, match="expected GB/s > 0.*'host': 0"):
        BandwidthModel.declared(1e-4, {"self": 8.0, "host": 0, "net": 0.1})
    with pytest.raises(ConfigError, match="expected seconds >= 0"):
        BandwidthModel.declared(-1e-4, LOOPBACK[1])
    with pytest.raises(ConfigError, match="expected 7 coefficients.*got shape \\(6,\\)"):
        BandwidthModel({"p2p": np.zeros(6)})
    with pytest.raises(ConfigError, match="source: expected one of"):
        BandwidthModel({}, "probe")
    assert BandwidthModel({"p2p": np.zeros(len(FEATURES))}).source == "given"
    assert BandwidthModel.declared(*DATACENTER).source == "declared"
    line = BandwidthModel.declared(150e-6, LOOPBACK[1], message_s=50e-6).describe()
    assert line == (
        "bandwidth model (declared): all_to_all/p2p/chunked4/gather: 150 us/call + 50 us/msg,"
        " self 8, host 1.5 (both 1.5), net 0.1 (both -) GB/s"
    )
    assert "\n" not in line


def _strategies(rank, world, pattern):
    import conduit_dist as cd
    from conduit_dist.collectives.exchange import Exchange
    from conduit_dist.collectives.strategies import make_strategies

    cd.init_distributed()
    ex = Exchange(30.0)
    rng = np.random.default_rng(1)
    rows = rng.integers(0, 6, (world, world))
    if pattern == "empty":
        rows[1, :] = 0
        rows[:, 2 % world] = 0
    if pattern == "hot":
        rows[:] = 0
        rows[:, 0] = [3, 9, 1][:world]
    width = 24
    inp = torch.cat(
        [
            torch.full((int(rows[rank, d]), width), 16 * rank + d, dtype=torch.uint8)
            for d in range(world)
        ]
    )
    results = {}
    for name, strat in make_strategies().items():
        out = torch.full((int(rows[:, rank].sum()), width), 255, dtype=torch.uint8)
        strat.run(ex, out, inp, rows[:, rank].tolist(), rows[rank].tolist(), 0, "test", rows)
        results[name] = out.clone()
    ex.close()
    expected = torch.cat(
        [
            torch.full((int(rows[s, rank]), width), 16 * s + rank, dtype=torch.uint8)
            for s in range(world)
        ]
    )
    return {n: torch.equal(v, expected) for n, v in results.items()}


@pytest.mark.parametrize("world", [2, 3])
def test_every_strategy_is_byte_identical_with_uneven_and_empty_splits(world):
    for pattern in ("uneven", "empty", "hot"):
        res = run_ranks(_strategies, world, pattern)
        for rank, ok in res.items():
            assert all(ok.values()), (pattern, rank, ok)
            assert set(ok) == set(NAMES)


def test_cache_round_trip_and_corrupt_or_mismatched_cache_is_ignored(tmp_path, caplog):
    topo = Topology.single_host(2)
    model = BandwidthModel(
        {n: np.array([1e-4, 1e-10, 6e-10, 5e-10, 0.0, 0.0, 2e-5]) for n in NAMES}, "calibrated"
    )
    path = cache_path(str(tmp_path), "gloo", topo)
    save_cache(path, model, "gloo", topo)
    loaded = load_cache(path, "gloo", topo)
    assert loaded is not None and loaded.source == "cache"
    assert all(np.allclose(loaded.coef[n], model.coef[n]) for n in NAMES)
    assert loaded.burst_bytes == {} and loaded.over_s == {}
    # a network knee is kept with the coefficients
    model.burst_bytes, model.over_s = {"all_to_all": 262_144.0}, {"all_to_all": 1.5e-8}
    save_cache(path, model, "gloo", topo)
    loaded = load_cache(path, "gloo", topo)
    assert loaded.burst_bytes == model.burst_bytes and loaded.over_s == model.over_s
    caplog.set_level(logging.WARNING, logger="conduit_dist")
    assert load_cache(path, "gloo", Topology.single_host(3)) is None  # other world size
    assert "ignored" in caplog.text
    with open(path, "w") as f:
        f.write("{not json")
    assert load_cache(path, "gloo", topo) is None
    data = {
        "version": CACHE_VERSION,
        "backend": "gloo",
        "world": 2,
        "hosts": topo.key(),
        "coef": {"p2p": [1]},
    }
    with open(path, "w") as f:
        json.dump(data, f)
    assert load_cache(path, "gloo", topo) is None


def _calibrated_plane(rank, world, cache_dir):
    from plane_helpers import make_batch, spec

    import conduit_dist as cd

    cd.init_distributed()
    plane = cd.DataPlane(
        spec(), 100, transport=cd.TransportConfig(bandwidth="calibrate", bandwidth_cache=cache_dir)
    )
    plane.put(make_batch(torch.arange(10) + 100 * rank))
    plane.fetch(4)
    out = plane.bandwidth.source, plane.calibration_s, [m.strategy for m in plane.stats.moves]
    plane.close()
    return out


def test_calibration_probes_once_then_reuses_the_cache_and_reprobes_a_corrupt_one(tmp_path):
    first = run_ranks(_calibrated_plane, 2, str(tmp_path))
    assert {r[0] for r in first.values()} == {"calibrated"}
    assert all(r[2] for r in first.values())  # the round's exchanges record their strategy
    second = run_ranks(_calibrated_plane, 2, str(tmp_path))
    assert {r[0] for r in second.values()} == {"cache"}
    for f in tmp_path.iterdir():
        f.write_text("corrupt")
    third = run_ranks(_calibrated_plane, 2, str(tmp_path))
    assert {r[0] for r in third.values()} == {"calibrated"}


def test_predictions_outside_the_model_go_through_predict():
    """A strategy's time is ``BandwidthModel.predict`` (its linear terms and a shaped link's
    burst knee): code that multiplied ``features`` by ``coef`` itself would drop the knee (bench
    strategies did, pricing a 4 MiB exchange on a 500 Mbit/s link ~15x too cheap). The LP bound
    is the one documented exception (a line rate's bound)."""
    import ast

    from dist_utils import ROOT

    allowed = {"conduit_dist/bench/lp_bound.py"}
    offenders = []
    for path in (ROOT / "conduit_dist").rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("conduit_dist/collectives/model/") or rel in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "features":
                offenders.append(f"{rel}:{node.lineno}")
            if isinstance(node, ast.Attribute) and node.attr == "coef":
                offenders.append(f"{rel}:{node.lineno}")
    assert not offenders, offenders
