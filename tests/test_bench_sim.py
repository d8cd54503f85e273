"""``bench sim`` validates the simulator out of sample against real rounds (here: 2 ranks, two
short jobs, each predicted from the other's calibration and fit) and projects its workloads to
4,096 ranks with a picture, from any working directory; values, not timings, are asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from dist_utils import child_env

from conduit_dist.sim import load


def test_bench_sim_validates_out_of_sample_projects_and_plots_from_another_cwd(tmp_path):
    # run outside the checkout: the picture goes to the default output directory under the cwd
    cmd = [sys.executable, "-m", "conduit_dist.bench", "sim", "--worlds", "2", "--samples", "10",
           "--topologies", "dgx_h100", "--host-rates"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=child_env(), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    png = tmp_path / "bench_out" / "sim_projection.png"
    assert line["bench"] == "sim" and png.stat().st_size > 10_000
    assert line["summary"]["plot"] == "bench_out/sim_projection.png"
    checks = line["results"]
    assert {c["case"] for c in checks} == {"fused", "fused_grads", "three_exchange"}
    # exposed latency where a round can be started early: the one-exchange rounds
    assert {c["case"] for c in checks if c["metric"] == "exposed"} == {"fused", "fused_grads"}
    # two jobs of 2 ranks (one per core here), each predicted from the other's calibration
    # and fit (no other layout ran): both scored, none from its own run
    assert {(c["where"], c["job"], c["scored"]) for c in checks} == {
        ("loopback, 2 ranks", 0, True),
        ("loopback, 2 ranks", 1, True),
    }
    for c in checks:
        other = f"loopback, 2 ranks, job {1 - c['job']}"
        assert c["calibration_source"] == other and c["fit_sources"] == [other], c
        assert c["load_1m"] >= 0  # the machine's load as the job started, beside its timings
    # a round always takes time; an exposed latency may be predicted 0 (a fitting run whose
    # round came out no slower than its raw collectives fits no bookkeeping, and the exchange
    # then hides behind the backward): 0 is a prediction, a negative one is a bug
    bad = [
        c
        for c in checks
        if not (
            c["measured_ms"] > 0
            and (c["predicted_ms"] > 0 if c["metric"] == "round" else c["predicted_ms"] >= 0)
        )
    ]
    s = line["summary"]
    assert not bad, f"checks {bad}; bookkeeping fits {s['bookkeeping_fits']}"
    assert s["worst_error_out_of_sample"] == max(abs(c["error"]) for c in checks)
    assert s["worst_error_in_sample"] == max(abs(c["error_in_sample"]) for c in checks)
    assert s["scored_set"] == ["loopback, 2 ranks"] and s["oversubscribed_set"] == []
    assert s["emulated_hosts"] == "not asked"  # no --host-rates: loopback only
    assert set(s["bookkeeping_fits"]) == {"loopback, 2 ranks, job 0", "loopback, 2 ranks, job 1"}
    assert s["median_exposed_error_out_of_sample"] is not None
    # the other job's fitted terms reach the simulated rounds: a three-exchange round's
    # bookkeeping is a round's and two further exchanges', stretched as this machine's cores
    # stretch 2 ranks
    stretch = load("loopback").oversubscription(2)
    for three in (c for c in checks if c["case"] == "three_exchange"):
        (source,) = three["fit_sources"]  # one run pooled: its own fit
        fit = s["bookkeeping_fits"][source]
        assert fit == three["bookkeeping_fit"]
        want = (fit["round_cpu_us"] + 2 * fit["exchange_cpu_us"]) * stretch / 1e3
        assert three["bookkeeping_predicted_ms"] == pytest.approx(want)
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
        assert c["dominant"] == ["send(weights)", "bytes_net"]


def test_the_json_line_is_printed_before_the_picture_is_drawn(tmp_path, monkeypatch, capsys):
    from conduit_dist.bench import sim

    drawn = []

    def plot(rows, path):  # the picture: by then the JSON line must be out
        drawn.append((capsys.readouterr().out, path))

    fake = {"workload": "dqn", "topology": "dgx_h100", "world": 8, "round_ms": 1.0}
    monkeypatch.setattr(sim, "project", lambda topo: ([fake], []))
    monkeypatch.setattr(sim, "plot", plot)
    monkeypatch.chdir(tmp_path)
    sim.main(["--no-validation", "--topologies", "dgx_h100", "--out-dir", "pictures"])
    ((out, path),) = drawn
    assert json.loads(out.strip().splitlines()[-1])["summary"]["plot"] == path
    assert path == "pictures/sim_projection.png" and (tmp_path / "pictures").is_dir()
    # an output directory that cannot be made is refused before anything runs
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exc:
        sim.main(["--no-validation", "--out-dir", str(tmp_path / "file" / "sub")])
    assert exc.value.code == 2 and "--out-dir" in capsys.readouterr().err
