"""``bench remote`` runs its systems side by side (a two-process conduit plane over gloo and one
over shared memory, the raw gloo floor in the same processes, TorchRL's Ray-hosted buffer on its
gloo transport) and reports each against the others; values, not timings, are asserted."""

from __future__ import annotations

import subprocess
import sys

from dist_utils import ROOT, bench_line, child_env

BENCH = [sys.executable, "-m", "conduit_dist.bench", "remote"]


def test_bench_remote_measures_conduit_raw_and_torchrl_side_by_side():
    args = ["--items", "300", "--batch", "64", "--samples", "3", "--warmup", "1", "--repeats", "1"]
    proc = subprocess.run([*BENCH, *args], cwd=ROOT, env=child_env(), capture_output=True,
                          text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = bench_line(proc.stdout)
    assert line["bench"] == "remote" and line["batch"] == 64 and line["placement"] == "local"
    systems = {r["system"] for r in line["results"]}
    assert systems == {"conduit", "conduit_shm", "raw", "torchrl"}, systems
    s = line["summary"]
    for key in ("conduit_ms", "conduit_shm_ms", "raw_ms", "torchrl_ms"):
        assert s[key] > 0, (key, s)
    assert s["conduit_vs_torchrl"] == s["torchrl_ms"] / s["conduit_ms"]
    assert s["conduit_shm_vs_torchrl"] == s["torchrl_ms"] / s["conduit_shm_ms"]
    assert s["raw_vs_torchrl"] == s["torchrl_ms"] / s["raw_ms"]


def test_bench_remote_refuses_a_batch_larger_than_the_store():
    proc = subprocess.run([*BENCH, "--items", "10", "--batch", "64", "--no-torchrl"], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2
    assert "--batch 64 is larger than --items 10" in proc.stderr, proc.stderr[-2000:]
