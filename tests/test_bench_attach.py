"""``bench attach`` under torchrun: producers outside the job join and leave a running token
plane, every delivered group once (values, not timings, are asserted)."""

from __future__ import annotations

import subprocess

from dist_utils import ROOT, TORCHRUN, bench_line, child_env


def test_bench_attach_reports_joins_and_delivers_every_group_once():
    cmd = [*TORCHRUN, "-m", "conduit_dist.bench", "attach", "--steps", "4", "--warmup", "0",
           "--groups", "4", "--group-size", "4", "--median", "32", "--compute-ms", "5",
           "--groups-per-producer", "6"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = bench_line(proc.stdout)
    assert line["bench"] == "attach" and line["world"] == 2
    fixed, churn = line["results"]
    assert fixed["phase"] == "fixed" and churn["phase"] == "churn"
    for row in (fixed, churn):
        assert row["groups_delivered"] == 16 and row["delivered_once"], row
        assert row["dropped_groups"] == 0 and row["duplicates"] == 0
        assert row["acked_puts"] >= 16
    assert fixed["producers_attached"] == 2 and churn["producers_attached"] >= 3  # some left
    s = line["summary"]
    assert s["delivered_once"] is True and s["attach_to_first_delivery_s"] > 0
    assert len(s["attach_to_first_delivery_samples"]) >= 2
    assert s["churn_over_fixed"] == s["step_ms_churn"] / s["step_ms_fixed"]
    assert "provenance" in line
