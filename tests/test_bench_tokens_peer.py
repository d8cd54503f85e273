"""``bench tokens --peer transferqueue`` runs TransferQueue (Ray, its controller, storage units,
sampler and streaming loader) beside the token plane under torchrun and checks both: every
group's bytes equal to what its producer put, every group whole and once (values, not timings,
are asserted)."""

from __future__ import annotations

import importlib.util
import subprocess

import pytest
from dist_utils import ROOT, TORCHRUN, bench_line, child_env

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transfer_queue") is None,
    reason="transferqueue is not installed (pip install -e '.[peers]')",
)

SIDES = ("ours", "transferqueue", "transferqueue_client")


def test_bench_tokens_peer_checks_both_sides():
    # 2 learners, 1 producer: groups split over learners, each checked to arrive on one only
    three = [*TORCHRUN[:-1], "--nproc_per_node=3"]
    cmd = [*three, "-m", "conduit_dist.bench", "tokens", "--peer", "transferqueue",
           "--learners", "2", "--sizes", "8", "--samples", "2", "--warmup", "1",
           "--median", "64"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=200)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = bench_line(proc.stdout)
    assert line["bench"] == "tokens_peer" and line["peer"] == "transferqueue"
    assert line["learner_ranks"] == [0, 1] and line["producer_ranks"] == [2]
    assert line["transport"] == "shared memory"  # ours and the raw exchange alike
    (row,) = line["results"]
    assert row["groups"] == 8 and row["sequences"] == 64
    s = line["summary"]
    for side in SIDES:
        assert s[f"digests_equal_{side}"] is True, side
        assert s[f"groups_whole_{side}"] is True, side
        total = row["ours_with_barrier_ms"] if side == "ours" else row[f"{side}_ms"]
        assert total >= row[f"{side}_delivery_ms"] > 0, side  # one pass: puts, then delivery
        assert row[f"micro_batches_per_learner_{side}"] >= 1, side
    assert row["ours_ms"] > 0
    assert s["speedup_vs_transferqueue"] == row["transferqueue_ms"] / row["ours_ms"]
    assert s["speedup_vs_transferqueue_same_barrier"] == (
        row["transferqueue_ms"] / row["ours_with_barrier_ms"]
    )
    assert s["ours_vs_raw_exchange"] == row["ours_delivery_ms"] / row["raw_exchange_ms"]
    assert row["bound_vs_raw_exchange"] == row["raw_with_gather_ms"] / row["raw_exchange_ms"]
    assert s["bound_vs_raw_exchange"] >= row["bound_vs_raw_exchange"] > 0


def test_bench_tokens_peer_refuses_a_world_without_producers():
    cmd = [*TORCHRUN, "-m", "conduit_dist.bench", "tokens", "--peer", "transferqueue",
           "--learners", "2"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.returncode != 0
    assert "--learners must leave at least one producer; got 2 learners" in proc.stderr
