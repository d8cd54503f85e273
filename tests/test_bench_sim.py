"""``bench sim`` validates the simulator against real rounds (here: 2 ranks, a short run) and
projects its workloads to 4,096 ranks with a plot; values, not timings, are asserted."""

from __future__ import annotations

import json
import subprocess
import sys

from dist_utils import ROOT, child_env


def test_bench_sim_validates_projects_and_plots(tmp_path):
    png = tmp_path / "sim.png"
    cmd = [sys.executable, "-m", "conduit_dist.bench", "sim", "--worlds", "2", "--samples", "10",
           "--topologies", "dgx_h100", "--plot", str(png)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["bench"] == "sim" and png.stat().st_size > 10_000
    checks = line["results"]
    assert {c["case"] for c in checks} == {"fused", "fused_grads", "three_exchange"}
    assert all(c["world"] == 2 and c["measured_ms"] > 0 and c["predicted_ms"] > 0 for c in checks)
    s = line["summary"]
    assert s["worst_error"] == max(abs(c["error"]) for c in checks)
    assert 0 < s["projection_s"] < 60
    worlds = sorted({r["world"] for r in line["projection"]})
    assert worlds[0] == 8 and worlds[-1] == 4096
    cross = {c["workload"]: c for c in s["crossovers"]["dgx_h100"]}
    assert set(cross) == {"dqn", "atari", "ppo"}
    for c in cross.values():  # every workload outgrows its backward somewhere up to 4,096
        assert c["world"] is not None and c["dominant"], c
