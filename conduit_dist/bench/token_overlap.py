"""``torchrun --standalone --nproc_per_node=2 -m conduit_dist.bench tokens --backward-ms 20``: how
much of a token plane's delivery the learner still waits for when the next global batch's round
starts at the backward (``TokenPlane.attach``), against rounds run inside ``fetch``, in one run.

Workload: every rank is a producer and a learner (colocated, as ``train.py experiment=grpo``):
per step it puts its share of the next global batch (``--groups-per-rank`` GRPO-shaped groups of
``--group-size``, lognormal lengths as ``bench tokens`` makes them), takes the current batch with
``fetch`` and runs one "backward" per micro-batch: a module's backward followed by
``--backward-ms`` of off-CPU time (a sleep standing in for a GPU's backward, as ``bench
latency`` does for the fixed plane). ``sync``: the rounds run inside ``fetch`` (the put of the
batch before it). ``overlap``: the module is attached, so the first backward after a take
launches the next batch's round on the plane's round thread, behind the rest of the step.

Each step's exposed wait is the wall time inside ``fetch`` (the slowest rank's, per step);
figures are medians over the steps after ``--warmup``. ``hidden_fraction`` is ``1 - overlap's /
sync's`` exposed wait; the iteration (put + fetch + backwards) of both modes is beside it, and
the launched rounds' own measured split (``TokenPlane.last_take``: hidden and exposed ms).
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

import conduit_dist as cd
from conduit_dist.bench.common import emit
from conduit_dist.bench.token_baselines import FIELDS, MAX_LEN, Data


def _steps(a, mode: str, spec) -> dict[str, list[float]]:
    """One mode's steps on this rank: per step its exposed wait, iteration and take timing."""
    me, world = dist.get_rank(), dist.get_world_size()
    per, size = a.groups_per_rank, a.group_size
    rng = np.random.default_rng(1000 + me)
    net = torch.nn.Linear(16, 16)
    out: dict[str, list[float]] = {"exposed": [], "iter": [], "hidden": [], "taken_exposed": []}
    with cd.TokenPlane(spec, 4 * per * size, 4 * per * size * 2 * MAX_LEN // 8) as tp:
        if mode == "overlap":
            tp.attach(net)
        steps = a.warmup + a.steps  # every batch generated first: the loop times the plane
        data = [Data(rng, per, size, a.median, base=(i * world + me) * per) for i in range(steps)]
        data.append(Data(rng, 1, size, a.median, base=(steps * world + me) * per))
        tp.put(*data[0].batch())
        for step in range(steps):
            dist.barrier()  # every step starts together: a step's slowest rank is its time
            t0 = time.perf_counter()
            mbs = tp.fetch(per * world, a.token_budget)
            t1 = time.perf_counter()
            tp.put(*data[step + 1].batch())  # the next batch, before the backward launching it
            for _ in mbs:
                net(torch.randn(8, 16)).sum().backward()
                time.sleep(a.backward_ms / 1e3)
            t2 = time.perf_counter()
            if step >= a.warmup:
                take = tp.last_take
                out["exposed"].append((t1 - t0) * 1e3)
                out["iter"].append((t2 - t0) * 1e3)
                out["hidden"].append(take.hidden_ms)
                out["taken_exposed"].append(take.exposed_ms)
        tp.detach()
    return out


def _slowest(values: list[float]) -> list[float]:
    """Each step's largest value over the ranks."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def run(a) -> None:
    """Both modes on every rank; the JSON line last on rank 0."""
    spec = cd.TokenSpec(
        {n: cd.Ragged(t, MAX_LEN) for n, t in FIELDS} | {"reward": ((), torch.float32)},
        group_size=a.group_size,
    )
    got = {mode: _steps(a, mode, spec) for mode in ("sync", "overlap")}
    med = {mode: {k: statistics.median(_slowest(v)) for k, v in got[mode].items()} for mode in got}
    s, o = med["sync"], med["overlap"]
    summary = {
        "exposed_ms_sync": round(s["exposed"], 3),
        "exposed_ms_overlap": round(o["exposed"], 3),
        "hidden_fraction": round(1 - o["exposed"] / s["exposed"], 4),
        "iteration_ms_sync": round(s["iter"], 2),
        "iteration_ms_overlap": round(o["iter"], 2),
        "launched_hidden_ms": round(o["hidden"], 3),
        "launched_exposed_ms": round(o["taken_exposed"], 3),
    }
    if dist.get_rank() == 0:
        print(
            f"tokens, backward {a.backward_ms} ms: exposed {s['exposed']:.2f} ms in sync, "
            f"{o['exposed']:.3f} ms with the round at the backward "
            f"(hidden fraction {summary['hidden_fraction']:.3f}); iteration "
            f"{s['iter']:.1f} -> {o['iter']:.1f} ms",
            flush=True,
        )
        emit(
            "tokens", [], summary, mode="overlap", world=dist.get_world_size(),
            groups_per_rank=a.groups_per_rank, group_size=a.group_size,
            backward_ms=a.backward_ms, steps=a.steps,
        )  # fmt: skip
