"""``bench rounds`` runs under torchrun from an empty store (its fill comes before the first
fetch, which may not ask for more than the store holds) and reports every case against its raw
collectives (values, not timings, are asserted), and that rounds allocate no tensor of their
own: every buffer of the hot path is pooled (a pool grows geometrically when a round needs more
rows than any before it, so a new tensor is rare, never per round)."""

from __future__ import annotations

import subprocess

from dist_utils import ROOT, TORCHRUN, bench_line, child_env


def test_bench_rounds_runs_every_case_from_an_empty_store():
    cmd = [*TORCHRUN, "-m", "conduit_dist.bench", "rounds", "--samples", "10", "--warmup", "1",
           "--alloc-rounds", "20"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = bench_line(proc.stdout)
    assert line["bench"] == "rounds" and line["world"] == 2
    cases = {r["case"]: r for r in line["results"]}
    assert {"fused", "fused_grads", "three_exchange", "main_job"} <= set(cases), set(cases)
    for r in cases.values():
        assert r["calls"] >= 1 and r["bytes"] > 0 and r["round_ms"] > 0 and r["raw_ms"] > 0
        assert r["torch_allocs"] <= 0.1, r  # e.g. 0.05: one pool growth in 20 early rounds
        assert r["py_peak_bytes"] > 0, r  # tracemalloc saw the round's Python objects
        # shared_memory="auto" (the default) on one host: replayed through it too, like for like
        assert r["shared_memory"] == (r["raw_shm_ms"] is not None), r


def test_the_allocation_counter_counts_new_storage_only():
    import numpy as np
    import torch

    from conduit_dist.bench.rounds import TensorAllocations

    a, out, small = torch.zeros(10), torch.empty(10), torch.empty(0)
    with TensorAllocations() as counted:
        a + 1  # new: 40 B
        a.add_(1)
        a.view(2, 5)
        torch.add(a, 1, out=out)  # into a buffer large enough
        torch.add(a, 1, out=small)  # resized: new, 40 B
        torch.cat([a, a])  # new: 80 B
        torch.from_numpy(np.zeros(3))  # NumPy's memory (tracemalloc's side)
        torch.tensor([1, 2])  # from Python data: new, 16 B
    assert (counted.count, counted.nbytes) == (4, 176)
