"""``bench tokens`` runs under torchrun and reports what it measured: the plane's delivery
carries no padding and balances tokens at least as well as dealing groups by count; the padded
baseline moves many times the data, the all-gather one about world times (values, not timings,
are asserted)."""

from __future__ import annotations

import subprocess

from dist_utils import ROOT, TORCHRUN, bench_line, child_env

KEYS = (
    "balance_max_over_mean", "wire_over_token_bytes", "speedup_vs_allgather", "ours_ms",
    "equal_counts_balance_max_over_mean", "equal_counts_ms", "padded_wire_over_token_bytes",
    "padded_ms", "allgather_ms", "allgather_wire_over_token_bytes", "raw_all_gather_ms",
    "raw_all_to_all_ms",
)  # fmt: skip


def test_bench_tokens_reports_balance_and_wire_bytes():
    cmd = [*TORCHRUN, "-m", "conduit_dist.bench", "tokens", "--groups-per-rank", "16",
           "--samples", "3", "--warmup", "1", "--median", "64"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = bench_line(proc.stdout)
    assert line["bench"] == "tokens" and line["world"] == 2
    s = line["summary"]
    assert set(KEYS) <= set(s), set(KEYS) - set(s)
    assert 1.0 <= s["wire_over_token_bytes"] <= 1.05
    assert 1.0 <= s["balance_max_over_mean"] <= s["equal_counts_balance_max_over_mean"] + 1e-9
    assert s["padded_wire_over_token_bytes"] > 2  # lognormal lengths: padding to the longest
    assert s["allgather_wire_over_token_bytes"] > 1.5  # each learner receives both ranks' data
    for key in KEYS:
        assert s[key] > 0, key
