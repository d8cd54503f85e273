"""``bench tokens`` runs under torchrun and reports what it measured: the plane's delivery
carries no padding and balances tokens at least as well as dealing groups by count; the padded
baseline moves many times the data (values, not timings, are asserted)."""

from __future__ import annotations

import json
import subprocess

from dist_utils import ROOT, TORCHRUN, child_env


def test_bench_tokens_reports_balance_and_wire_bytes():
    cmd = [*TORCHRUN, "-m", "conduit_dist.bench", "tokens", "--groups-per-rank", "8",
           "--samples", "3", "--warmup", "1", "--median", "64"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(proc.stdout.strip().splitlines()[-1])["summary"]
    assert 1.0 <= s["wire_over_token_bytes"] <= 1.05
    assert 1.0 <= s["balance_max_over_mean"] <= s["equal_counts_balance_max_over_mean"] + 1e-9
    assert s["padded_wire_over_token_bytes"] > 2  # lognormal lengths: padding to the longest
    for key in ("speedup_vs_allgather", "ours_ms", "allgather_ms", "raw_all_gather_ms"):
        assert s[key] > 0, key
