"""``python -m conduit_dist.bench rllib`` runs both buffers behind RLlib's calls and reports
each one's training step and the ratio (tiny sizes: a check that it runs, not a timing)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("ray.rllib", reason="needs the [rllib] extra (scripts/run_tests.sh)")


def test_bench_rllib_times_both_buffers_behind_the_same_calls():
    cmd = [sys.executable, "-m", "conduit_dist.bench", "rllib", "--capacity", "600",
           "--steps", "4000", "--batches", "8", "--repeats", "1", "--min-time", "0.02"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert line["bench"] == "rllib" and line["filled"] == 600
    got = {(r["buffer"], r["batch"]) for r in line["results"]}
    assert got == {("rllib", 8), ("conduit", 8)}
    for r in line["results"]:
        assert r["step_ms"] > 0 and r["steps_timed"] > 0
        assert r["sample_ms"] > 0 and r["add_ms"] > 0 and r["update_ms"] > 0
    s = line["summary"]
    assert s["speedup_b8"] > 0 and s["floor_ms_b8"] > 0 and s["items_ms_b8"] > 0
    step = {r["buffer"]: r["step_ms"] for r in line["results"]}
    assert s["speedup_b8"] == pytest.approx(step["rllib"] / step["conduit"])
    assert s["bound_speedup_b8"] == pytest.approx(step["rllib"] / s["items_ms_b8"])
