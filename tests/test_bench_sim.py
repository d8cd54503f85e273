"""``bench sim`` validates the simulator against real rounds (here: 2 ranks, a short run) and
projects its workloads to 4,096 ranks with a plot; values, not timings, are asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from dist_utils import ROOT, child_env

from conduit_dist.sim import load


def test_bench_sim_validates_projects_and_plots(tmp_path):
    png = tmp_path / "sim.png"
    # one calibration serves the fitting and the validation run (--cache-dir)
    cmd = [sys.executable, "-m", "conduit_dist.bench", "sim", "--worlds", "2", "--samples", "10",
           "--topologies", "dgx_h100", "--plot", str(png), "--host-rates",
           "--cache-dir", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["bench"] == "sim" and png.stat().st_size > 10_000
    checks = line["results"]
    assert {c["case"] for c in checks} == {"fused", "fused_grads", "three_exchange"}
    # exposed latency where a round can be started early: the one-exchange rounds
    assert {c["case"] for c in checks if c["metric"] == "exposed"} == {"fused", "fused_grads"}
    # a round always takes time; an exposed latency may be predicted 0 (a fitting run whose
    # round came out no slower than its raw collectives fits no bookkeeping, and the exchange
    # then hides behind the backward): 0 is a prediction, a negative one is a bug
    bad = [
        c
        for c in checks
        if not (
            c["world"] == 2
            and c["measured_ms"] > 0
            and (c["predicted_ms"] > 0 if c["metric"] == "round" else c["predicted_ms"] >= 0)
        )
    ]
    assert not bad, f"checks {bad}; bookkeeping fit {line['summary']['bookkeeping_fit']}"
    s = line["summary"]
    assert s["worst_error"] == max(abs(c["error"]) for c in checks)
    assert s["emulated_hosts"] == "not asked"  # no --host-rates: loopback only
    assert set(s["bookkeeping_fit"]) == {"round_cpu_us", "exchange_cpu_us", "payload_gbps"}
    assert s["median_exposed_error"] is not None
    # the fitted terms reach the simulated rounds: a three-exchange round's bookkeeping is a
    # round's and two further exchanges', stretched as this machine's cores stretch 2 ranks
    fit, stretch = s["bookkeeping_fit"], load("loopback").oversubscription(2)
    three = next(c for c in checks if c["case"] == "three_exchange")
    want = (fit["round_cpu_us"] + 2 * fit["exchange_cpu_us"]) * stretch / 1e3
    assert three["bookkeeping_predicted_ms"] == pytest.approx(want)
    assert s["median_error_held_out"] is None  # only the fitted configuration ran
    assert 0 < s["projection_s"] < 60
    worlds = sorted({r["world"] for r in line["projection"]})
    assert worlds[0] == 8 and worlds[-1] == 4096
    cross = {c["workload"]: c for c in s["crossovers"]["dgx_h100"]}
    assert set(cross) == {"dqn", "atari", "ppo", "llm-1b", "llm-8b", "llm-70b"}
    for name in ("dqn", "atari", "ppo"):  # outgrow their backward somewhere up to 4,096
        assert cross[name]["world"] is not None and cross[name]["dominant"], cross[name]
    assert cross["atari"]["faster"] == "placement=bandwidth_aware"
    for name in ("llm-1b", "llm-8b", "llm-70b"):  # hidden behind a step of seconds throughout
        c = cross[name]
        assert c["world"] is None and 0 < c["round_over_backward"] < 1, c
        assert c["dominant"] == ["broadcast(weights)", "bytes_net"]
