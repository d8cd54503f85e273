"""``torchrun --standalone --nproc_per_node=2 -m conduit_dist.bench tokens --cost flops
--learner-cost sleep``: balance measured as the learners' step time, not as tokens.

Workload: ``bench tokens``' GRPO-shaped groups (``--group-size`` responses, lengths lognormal
with median ``--median`` tokens and sigma 1, 1% of them 6,144-8,192 tokens), ``--groups-per-rank``
fresh groups per rank and sample; every rank learns. Each learner's "step" stands in for its GPU
work: for each of its micro-batches it sleeps until ``cost * scale`` seconds after the previous
one ended, where ``cost`` is ``sum(a*L + b*L**2)`` over the micro-batch's sequences (one
transformer layer of width ``--d-model``: ``tokens.cost.Flops.for_model``), and ``scale`` makes
the mean learner's step ``--step-ms`` (fixed from the first sample's batch). The same batches go
three ways, measured side by side in one run, the order rotating per sample:

- ``cost``: a ``TokenPlane(cost=--cost, token_cap=--token-cap)`` fetch (``--cost flops``: the
  same coefficients as the step, its best case; ``--plan-d-model`` makes the plane assume
  another width, the neutral case of a cost model that does not fit; ``tokens``: by tokens);
- ``tokens``: a ``TokenPlane(cost="tokens", token_cap=--token-cap)`` fetch (today's balance);
- ``equal_counts``: groups dealt by count (``bench tokens``' baseline), micro-batches of equal
  group counts.

``--learner-cost matmul`` replaces the sleep by real compute, measured independently of any cost
model: for each sequence of ``L`` tokens (one at a time, as varlen attention runs them) a dense
block ``x @ W1 @ W2`` (``[L, w] x [w, 4w] x [4w, w]``) and non-causal attention ``(x x^T) x``
in query blocks of 256 rows, ``w = --matmul-width``, on one CPU thread into preallocated
buffers. Its counted FLOPs are ``16 w^2 L + 4 w L^2``: ``--cost flops`` then plans with
``Flops(a=4w, b=1)`` (the FLOP count, not a fit of the measured times), ``--plan-d-model``
with ``Flops.for_model`` (a misfit). Seconds per sample are several times the sleep's: use
fewer groups (``--groups-per-rank 16 --samples 11``).

Per sample and scheme the step time of every learner is measured after a barrier; the figure is
the slowest learner's step over the mean, median over samples: ``step_time_max_over_mean``
(``cost``), ``tokens_step_time_max_over_mean``, ``equal_counts_step_time_max_over_mean``. Beside
each: the same ratio of the modelled cost (``..._cost_max_over_mean``, no timing in it), the mean
step in ms, the micro-batch count and the largest micro-batch's tokens (never above the cap for
the planes; the equal-counts baseline knows no cap).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

import conduit_dist as cd
from conduit_dist.bench.common import emit, number
from conduit_dist.bench.token_baselines import FIELDS, MAX_LEN, Data, Pool, run_equal
from conduit_dist.tokens.cost import Flops

SCHEMES = ("cost", "tokens", "equal_counts")
TARGET = 1.05  # the bound on step_time_max_over_mean with cost=flops


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m conduit_dist.bench tokens --learner-cost sleep")
    p.add_argument("--cost", choices=("flops", "tokens"), default="flops",
                   help="what the measured plane balances by")  # fmt: skip
    p.add_argument("--learner-cost", choices=("sleep", "matmul"), default="sleep",
                   help="a learner's step: a sleep proportional to a*L + b*L^2, or real "
                   "dense + attention matmuls on the CPU")  # fmt: skip
    p.add_argument("--matmul-width", type=number(int, 1), default=32,
                   help="the matmul step's width w")  # fmt: skip
    p.add_argument("--groups-per-rank", type=number(int, 1), default=64)
    p.add_argument("--group-size", type=number(int, 1), default=8)
    p.add_argument("--median", type=number(float, 16), default=256.0, help="median length")
    p.add_argument("--d-model", type=number(int, 1), default=4096, help="the step's layer width")
    p.add_argument(
        "--plan-d-model", type=number(int, 1), default=None,
        help="the width the plane's flops cost assumes (default: --d-model; another value "
        "measures a misfit cost model)",
    )  # fmt: skip
    p.add_argument("--token-budget", type=number(int, MAX_LEN), default=16_384)
    p.add_argument("--token-cap", type=number(int, MAX_LEN), default=32_768)
    p.add_argument("--step-ms", type=number(float, 1), default=40.0, help="the mean step")
    p.add_argument("--samples", type=number(int, 3), default=31)
    p.add_argument("--warmup", type=number(int, 0), default=2)
    return p


def _step(mbs: list, flops: Flops, scale_s: float) -> tuple[float, int]:
    """Run a learner's step over ``mbs``: each micro-batch ends ``cost * scale_s`` seconds
    after the previous one (slept to a deadline, so oversleeping does not add up). Returns the
    step's seconds and its modelled cost."""
    t0 = time.perf_counter()
    due, total = t0, 0
    for mb in mbs:
        c = int(flops(mb["_length"].numpy()).sum())
        total += c
        due += c * scale_s
        pause = due - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
    return time.perf_counter() - t0, total


class _Matmul:
    """A learner's step as real CPU compute (see the module docstring), buffers made once."""

    BLOCK = 256

    def __init__(self, width: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(MAX_LEN, width, generator=g) / width**0.5
        self.w1 = torch.randn(width, 4 * width, generator=g) / width**0.5
        self.w2 = torch.randn(4 * width, width, generator=g) / (4 * width) ** 0.5
        self.h = torch.empty(MAX_LEN, 4 * width)
        self.y = torch.empty(MAX_LEN, width)
        self.s = torch.empty(self.BLOCK * MAX_LEN)
        self.cost = Flops(a=4 * width, b=1)  # 16 w^2 L + 4 w L^2 in units of 4 w FLOPs

    def __call__(self, mbs: list) -> tuple[float, int]:
        """Run the step over ``mbs``: its seconds and its counted cost."""
        t0, total = time.perf_counter(), 0
        for mb in mbs:
            lengths = mb["_length"].tolist()
            total += int(self.cost(np.asarray(lengths)).sum())
            for n in lengths:
                x = self.x[:n]
                torch.mm(x, self.w1, out=self.h[:n])
                torch.mm(self.h[:n], self.w2, out=self.y[:n])
                for q in range(0, n, self.BLOCK):
                    rows = min(self.BLOCK, n - q)
                    s = self.s[: rows * n].view(rows, n)
                    torch.mm(x[q : q + rows], x.T, out=s)
                    torch.mm(s, x, out=self.y[q : q + rows])
        return time.perf_counter() - t0, total


def main(argv: list[str]) -> None:
    """Run the balance-in-time benchmark (every rank); rank 0 prints the JSON line last."""
    a = _parser().parse_args(argv)
    cd.init_distributed()
    torch.set_num_threads(1)
    try:
        _run(a)
    finally:
        cd.destroy_distributed()


def _run(a: argparse.Namespace) -> None:
    me, world = dist.get_rank(), dist.get_world_size()
    spec = cd.TokenSpec(
        {n: cd.Ragged(t, MAX_LEN) for n, t in FIELDS} | {"reward": ((), torch.float32)},
        group_size=a.group_size,
    )
    flops = Flops.for_model(a.d_model)
    per, size = a.groups_per_rank, a.group_size
    cap_items, cap_tokens = 4 * per * size, per * size * MAX_LEN
    matmul = _Matmul(a.matmul_width) if a.learner_cost == "matmul" else None
    if matmul is not None:
        assumed = matmul.cost if a.plan_d_model is None else Flops.for_model(a.plan_d_model)
    else:
        assumed = Flops.for_model(a.plan_d_model or a.d_model)
    cost = assumed if a.cost == "flops" else "tokens"
    planes = {
        "cost": cd.TokenPlane(spec, cap_items, cap_tokens, cost=cost, token_cap=a.token_cap),
        "tokens": cd.TokenPlane(spec, cap_items, cap_tokens, token_cap=a.token_cap),
    }
    rng = np.random.default_rng(2000 + me)
    pool = Pool()  # the equal-count baseline's buffers (its micro-batches live until the next)
    steps = {k: [] for k in SCHEMES}  # [sample] -> this rank's (seconds, cost)
    shape = {k: [] for k in SCHEMES}  # [sample] -> (micro-batches, largest micro-batch tokens)
    scale_s = 0.0
    for i in range(a.warmup + a.samples):
        d = Data(rng, per, size, a.median, base=(i * world + me) * per)
        mbs = {}
        for k, tp in planes.items():
            tp.put(*d.batch())
            mbs[k] = tp.fetch(per * world, a.token_budget)
        mbs["equal_counts"] = run_equal(d, pool, a.token_budget)[0]
        if not scale_s and matmul is None:  # the mean learner's step is step_ms
            total = torch.tensor([int(flops(d.lengths.numpy()).sum())], dtype=torch.float64)
            dist.all_reduce(total)
            scale_s = a.step_ms / 1e3 / (float(total) / world)
        k0 = i % len(SCHEMES)
        got = {}
        for k in SCHEMES[k0:] + SCHEMES[:k0]:
            dist.barrier()
            got[k] = matmul(mbs[k]) if matmul is not None else _step(mbs[k], flops, scale_s)
        if i < a.warmup:
            continue
        for k in SCHEMES:
            steps[k].append(got[k])
            shape[k].append((len(mbs[k]), max(int(mb["_length"].sum()) for mb in mbs[k])))
    for tp in planes.values():
        tp.close()
    mine = torch.tensor([steps[k] for k in SCHEMES], dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)  # [rank][scheme, sample, (seconds, cost)]
    shapes = torch.tensor([shape[k] for k in SCHEMES], dtype=torch.int64)
    counts = [torch.empty_like(shapes) for _ in range(world)]
    dist.all_gather(counts, shapes)
    if me == 0:
        _report(a, world, torch.stack(every), torch.stack(counts))


def _ratio(x: torch.Tensor) -> float:
    """Median over samples of the largest over the mean of ``x[rank, sample]``."""
    return statistics.median((x.max(0).values / x.mean(0)).tolist())


def _report(a: argparse.Namespace, world: int, every: torch.Tensor, counts: torch.Tensor) -> None:
    summary: dict[str, float] = {}
    for j, pre in enumerate(("", "tokens_", "equal_counts_")):
        secs, cost = every[:, j, :, 0], every[:, j, :, 1]
        summary[f"{pre}step_time_max_over_mean"] = _ratio(secs)
        summary[f"{pre}cost_max_over_mean"] = _ratio(cost)
        summary[f"{pre}step_ms_mean"] = statistics.median((secs.mean(0) * 1e3).tolist())
        summary[f"{pre}micro_batches"] = statistics.median(counts[0, j, :, 0].tolist())
        summary[f"{pre}max_micro_batch_tokens"] = float(counts[:, j, :, 1].max())
    summary["token_cap"] = float(a.token_cap)
    summary["target_met"] = float(summary["step_time_max_over_mean"] <= TARGET)
    for k, v in summary.items():
        print(f"{k:>44}: {v:.4g}", flush=True)
    results = [
        {"scheme": k, "step_time_max_over_mean": summary[f"{pre}step_time_max_over_mean"]}
        for k, pre in zip(SCHEMES, ("", "tokens_", "equal_counts_"), strict=True)
    ]
    emit(
        "token_balance",
        results,
        summary,
        world=world,
        cost=a.cost,
        learner_cost=a.learner_cost,
        d_model=a.d_model,
        plan_d_model=a.plan_d_model or a.d_model,
        matmul_width=a.matmul_width if a.learner_cost == "matmul" else None,
        groups_per_rank=a.groups_per_rank,
        group_size=a.group_size,
        median=a.median,
        token_budget=a.token_budget,
        token_cap=a.token_cap,
        step_ms=a.step_ms,
        samples=a.samples,
    )
