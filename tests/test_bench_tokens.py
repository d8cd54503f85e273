"""``bench tokens`` runs under torchrun and reports what it measured: the plane's delivery
carries no padding and balances tokens at least as well as dealing groups by count; the padded
baseline (each micro-batch padded to its own longest) moves many times the data, the all-gather
reference about world times; a sweep reports each size, the fair ratio first (values, not
timings, are asserted)."""

from __future__ import annotations

import subprocess

from dist_utils import ROOT, TORCHRUN, bench_line, child_env

KEYS = (
    "ours_vs_equal_counts", "ours_gloo_ms", "ours_default_vs_equal_counts",
    "balance_max_over_mean", "wire_over_token_bytes", "ours_ms",
    "equal_counts_balance_max_over_mean", "equal_counts_ms", "padded_wire_over_token_bytes",
    "padded_ms", "reference_allgather_ms", "reference_allgather_over_ours",
    "reference_allgather_wire_over_token_bytes", "raw_all_gather_ms", "raw_all_to_all_ms",
    "ours_vs_raw_all_to_all",
)  # fmt: skip


def test_bench_tokens_reports_balance_and_wire_bytes():
    cmd = [*TORCHRUN, "-m", "conduit_dist.bench", "tokens", "--groups-per-rank", "16,24",
           "--samples", "3", "--warmup", "2", "--median", "64"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = bench_line(proc.stdout)
    assert line["bench"] == "tokens" and line["world"] == 2
    s = line["summary"]
    assert list(s)[:2] == ["groups_per_rank", "ours_vs_equal_counts"], list(s)[:3]  # fair first
    assert [x["groups_per_rank"] for x in s["sweep"]] == [16, 24] and s["sweep"][0] == {
        k: v for k, v in s.items() if k != "sweep"
    }
    assert {(r["groups_per_rank"], r["scheme"]) for r in line["results"]} >= {
        (16, "ours"),
        (24, "equal"),
        (24, "padded"),
    }
    # tiny random batches can outgrow a warm-up's 2x headroom: counted, not forbidden
    assert isinstance(s["baseline_buffers_grown_in_timed_samples"], int)
    assert set(KEYS) <= set(s), set(KEYS) - set(s)
    assert 1.0 <= s["wire_over_token_bytes"] <= 1.05
    assert 1.0 <= s["balance_max_over_mean"] <= s["equal_counts_balance_max_over_mean"] + 1e-9
    # lognormal lengths: padding each micro-batch to its longest still moves several times the data
    assert s["padded_wire_over_token_bytes"] > 2
    assert s["reference_allgather_wire_over_token_bytes"] > 1.5  # every learner gets all data
    for key in KEYS:
        assert s[key] > 0, key


def test_baseline_buffers_are_reused_and_growths_counted():
    import torch

    from conduit_dist.bench.token_baselines import Pool

    pool = Pool()
    a = pool.get("recv", 100)
    assert pool.grown == 1 and a.numel() == 100
    b = pool.get("recv", 180, torch.int32)  # within the 2x headroom: the same memory
    assert pool.grown == 1 and b.numel() == 45 and b.data_ptr() == a.data_ptr()
    pool.reset_count()
    c = pool.get("recv", 1000)  # beyond it: a new, larger buffer, counted
    assert pool.grown == 1 and c.numel() == 1000 and int(c.sum()) == 0
    pool.get("send", 8)
    assert pool.grown == 2
