"""``bench weights`` under torchrun on 4 ranks (2 learners, 2 producers): every path delivers
the same bytes, each learner writes about half of what crosses the sockets, and the summary's
ratios are the results' times (values, not timings, are asserted)."""

from __future__ import annotations

import subprocess

import pytest
from dist_utils import ROOT, TORCHRUN, bench_line, child_env


@pytest.mark.parametrize(
    "extra", [["--bucket-mb", "0.25"], ["--shared-memory", "--copy"], ["--fsdp"]]
)
def test_bench_weights_delivers_equal_digests_from_both_learners(extra):
    cmd = [*[a.replace("--nproc_per_node=2", "--nproc_per_node=4") for a in TORCHRUN], "-m",
           "conduit_dist.bench", "weights", "--gib", "0.004", "--repeats", "2", *extra]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = bench_line(proc.stdout)
    assert line["bench"] == "weights" and line["learners"] == 2 and line["producers"] == 2
    s = line["summary"]
    assert s["digests_equal"] is True
    assert s["busiest_rank_bytes_share_schedule"] == 0.5  # each learner half, to each producer
    assert s["busiest_rank_bytes_share"] <= 0.55
    shm = "--shared-memory" in extra
    assert s["bytes_share_source"] == ("packed into /dev/shm" if shm else "sockets")
    paths = {r["path"]: r for r in line["results"]}
    assert set(paths) == {
        "ours_send_now", "ours_snapshot", "raw_p2p", "raw_broadcast", "raw_schedule", "current"
    }  # fmt: skip
    by_rank = paths["ours_send_now"]["socket_bytes_by_rank"]
    if not shm:  # the learners' parts crossed the sockets, the producers sent little
        assert min(by_rank[:2]) > 0.45 * line["model_bytes"] and max(by_rank[2:]) < 65536
    t = {k: r["s"] for k, r in paths.items()}
    fastest = min(t["raw_p2p"], t["raw_broadcast"], t["raw_schedule"])
    assert s["vs_raw"] == round(fastest / t["ours_send_now"], 3)
    assert s["schedule"] == ("shm" if shm else "p2p")  # one host: no relay
    assert paths["raw_schedule"]["schedule"] == "p2p"
    assert s["vs_current"] == round(t["current"] / t["ours_send_now"], 3)
    last = paths["ours_send_now"]["last_transfer"]
    assert last["schedule"] == ("shm" if shm else "p2p") and last["owners"] == [0, 1]
    if shm:
        assert line["load"] == "copy" and line["shared_memory"] is True
    else:  # 0.25 MiB pieces of each learner's ~2 MiB part
        assert line["load"] == "in_place" and last["sent"] > 0 and last["buckets"] >= 8
