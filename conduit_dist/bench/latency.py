"""``torchrun --standalone --nproc_per_node=2 -m conduit_dist.bench latency``: exposed latency.

One run, both schedules, the same learner workload and the same experience volume:

- **learner**: an MLP (DDP over the ranks) whose backward takes tens of milliseconds;
- **experience**: every iteration each rank puts ``items`` Atari-like transitions (56 KB) and
  fetches a batch of ``--batch`` of them (``round_robin`` placement: about half of both cross
  ranks). ``items`` is calibrated at start, per put kind, so the request-driven (``sync``)
  round takes about as long as the learner's compute, i.e. the experience path is about half of
  the sync iteration: extrapolated from a 256-item probe, then timed warm at that size and
  rescaled once.
- **put**: ``donated`` (``put(batch, donate=True)``: packed by the round, so in ``overlap`` mode
  during backward) and ``copying`` (``put(batch)``: packed inside ``put``, outside the fetch in
  both modes), each with its round sized to the compute; and ``copying_same_volume``, a copying
  put of the donated volume (the neutral setting: the same bytes, and the copy that no schedule
  can hide, ~a tenth of the iteration, stays in both modes).

Per iteration: time the learner waited inside ``fetch`` (exposed latency) and the whole iteration
(``put`` included). The four (put, mode) settings alternate in blocks; medians per setting;
cuts = 1 - overlap / sync per put kind and learner. Then the same two numbers for
``train.py experiment=cartpole_dqn`` iterations (composed with Hydra, run in process for a fixed
number of learning iterations per mode). A PNG plot of per-iteration exposed vs hidden time is
written next to the JSON (``--out``). Every option is checked before anything runs.

The JSON line (last) has ``summary.donated`` and ``summary.copying``, each
``{"offcpu": {"exposed_cut", "iteration_cut"}, "cpu": {...}}``; the older flat keys
(``exposed_reduction``, ``iteration_reduction`` and their ``offcpu_`` forms) stay, holding the
donated numbers.

This module sizes and runs the settings (and the DQN part); the transitions, the learners and the
settings compared are in ``latency_workload.py``, the plot and the printed report in
``latency_report.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import conduit_dist as cd
from conduit_dist.bench.common import emit, number, out_path
from conduit_dist.bench.latency_report import plot, report, report_dqn
from conduit_dist.bench.latency_workload import (
    MODES,
    OBS_BYTES,
    PUTS,
    Learner,
    OffCpuLearner,
    make_batch,
    train_step,
)

DQN_WARMUP = 20  # learning iterations of each DQN run left out of its medians


def _run_mode(
    schedule: str,
    items: int,
    batch_size: int,
    iters: int,
    model,
    opt,
    spec,
    seed: int,
    placement: str,
    donate: bool,
) -> dict:
    rank = dist.get_rank()
    plane = cd.DataPlane(
        spec, max(4 * items, 1024), seed=seed, schedule=schedule, placement=placement
    )
    plane.attach(model)
    batches = [make_batch(items, seed=rank * 100 + i) for i in range(2)]
    for i in range(3):  # fill the store
        plane.put(batches[i % 2])
        plane.flush()
    plane.wait()
    iter_ms, exposed, hidden, put_ms = [], [], [], []
    for i in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        plane.put(batches[i % 2], donate=donate)  # donated: packed by the round, not by put
        t1 = time.perf_counter()
        batch = plane.fetch(batch_size)
        t2 = time.perf_counter()
        train_step(model, opt, batch)
        t3 = time.perf_counter()
        if i >= 2:  # the first iterations of a mode are warm-up
            iter_ms.append((t3 - t0) * 1e3)
            exposed.append((t2 - t1) * 1e3)
            hidden.append(plane.last_fetch.hidden_ms)
            put_ms.append((t1 - t0) * 1e3)
    plane.close()
    return {"iter": iter_ms, "exposed": exposed, "hidden": hidden, "put": put_ms}


def _calibrate(
    model, opt, spec, target_ratio: float, placement: str, batch_size: int, donate: bool
) -> tuple[int, float]:
    """Items put per iteration so that a sync round (after a put of that kind) takes about
    ``target_ratio`` x the compute."""
    probe = 256
    plane = cd.DataPlane(spec, 2 * 4096, seed=0, schedule="sync", placement=placement)
    b = make_batch(probe, seed=dist.get_rank())
    rounds, comp, empty = [], [], []
    for i in range(6):
        plane.put(b, donate=donate)
        t0 = time.perf_counter()
        batch = plane.fetch(batch_size)
        t1 = time.perf_counter()
        train_step(model, opt, batch)
        t2 = time.perf_counter()
        plane.fetch(batch_size)  # the same round with nothing put: delivery alone
        if i >= 2:
            rounds.append(t1 - t0)
            comp.append(t2 - t1)
            empty.append(time.perf_counter() - t2)
    deliver = statistics.median(empty)
    per_item = max(statistics.median(rounds) - deliver, 1e-6) / probe
    budget = target_ratio * statistics.median(comp) - deliver
    items = _agree(max(budget, 0.0) / per_item)
    # a round's cost is not linear in its size (caches, buffers growing into fresh memory on
    # their first rounds): time the estimate once warm, and rescale
    big = make_batch(items, seed=dist.get_rank())
    measured = []
    for _ in range(8):
        plane.put(big, donate=donate)
        t0 = time.perf_counter()
        plane.fetch(batch_size)
        measured.append(time.perf_counter() - t0)
    plane.close()
    per_item = max(statistics.median(measured[4:]) - deliver, 1e-6) / items
    return _agree(max(budget, 0.0) / per_item), statistics.median(comp)


def _agree(items: float) -> int:
    """The smallest proposal over ranks, clamped to [16, 4096] items."""
    t = torch.tensor([items])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(max(16, min(4096, t.item())))


def _dqn(iters: int) -> dict[str, dict[str, float]]:
    """Median iteration and exposed time of train.py experiment=cartpole_dqn, per schedule."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from conduit_dist.train.config import register
    from conduit_dist.train.metrics import NullLogger
    from conduit_dist.train.trainer import Trainer

    register()
    conf = os.path.join(os.path.dirname(__file__), "..", "..", "conf")
    out = {}
    for schedule in ("sync", "overlap", "auto"):
        with initialize_config_dir(config_dir=os.path.abspath(conf), version_base="1.3"):
            dcfg = compose(
                "config",
                overrides=[
                    "experiment=cartpole_dqn",
                    "logger=none",
                    f"plane.schedule={schedule}",
                    "target_return=null",
                    "algo.learning_starts=1000",
                    f"total_env_steps={1000 + iters * 8 * dist.get_world_size()}",
                ],
            )
        trainer = Trainer(OmegaConf.to_object(dcfg), NullLogger())
        try:
            trainer.run()
        finally:
            trainer.close()
        rec = trainer.records[DQN_WARMUP:]
        out[schedule] = {
            "iteration_ms": statistics.median(r[0] for r in rec),
            "exposed_ms": statistics.median(r[1] for r in rec),
        }
    return out


def _measure(learner: str, a, spec, compute_ms: float | None) -> dict:
    """Calibrate the volume for one learner kind; run every (put, mode) in alternating blocks."""
    torch.manual_seed(0)
    if learner == "cpu":
        model = Learner(a.features, a.hidden, a.layers)
    else:  # the same duration, spent off the host CPU (as a GPU backward would be)
        model = OffCpuLearner(a.features, compute_ms / 1e3)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    sized = {}  # calibrating put kind -> (items, compute seconds)
    for kind in ("donated", "copying"):
        args = (ddp, opt, spec, a.ratio, a.placement, a.batch, PUTS[kind][0])
        sized[kind] = _calibrate(*args)
    items = {put: sized[by][0] for put, (_, by) in PUTS.items()}
    keys = ("iter", "exposed", "hidden", "put")
    results = {put: {m: {k: [] for k in keys} for m in MODES} for put in PUTS}
    for block in range(a.blocks):
        for put, (donate, _) in PUTS.items():
            for mode in MODES:
                r = _run_mode(
                    mode, items[put], a.batch, a.iters + 2, ddp, opt, spec, block, a.placement,
                    donate,
                )  # fmt: skip
                for k, v in r.items():
                    results[put][mode][k] += v
    med = {
        put: {m: {k: statistics.median(v) for k, v in r.items()} for m, r in by_mode.items()}
        for put, by_mode in results.items()
    }
    comp = sized["donated"][1]
    return {"items": items, "compute_ms": comp * 1e3, "raw": results, "median": med}


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse and check every option before anything is measured (errors name the flag)."""
    p = argparse.ArgumentParser(prog="python -m conduit_dist.bench latency")
    p.add_argument("--iters", type=number(int, 1), default=24, help="iterations per block")
    p.add_argument("--blocks", type=number(int, 1), default=2, help="alternating blocks")
    p.add_argument("--hidden", type=number(int, 1), default=1024)
    p.add_argument("--layers", type=number(int, 1), default=3)
    p.add_argument("--features", type=number(int, 1), default=2048, help=f"<= {OBS_BYTES}")
    p.add_argument(
        "--ratio", type=number(float, 0, strict=True), default=1.0, help="sync round / compute"
    )
    p.add_argument("--batch", type=number(int, 1), default=256, help="items the learner fetches")
    p.add_argument("--placement", default="round_robin", choices=["round_robin", "local"])
    p.add_argument("--dqn-iters", type=number(int, 0), default=1500, help="0 skips the DQN part")
    p.add_argument("--out", type=out_path(".png"), default="bench_out/latency.png", help="the plot")
    a = p.parse_args(argv)
    if a.features > OBS_BYTES:
        p.error(f"--features: expected <= {OBS_BYTES} (bytes of an observation), got {a.features}")
    if 0 < a.dqn_iters < 2 * DQN_WARMUP:
        p.error(
            f"--dqn-iters: expected 0 (skip) or >= {2 * DQN_WARMUP} (the first {DQN_WARMUP} "
            f"learning iterations are warm-up), got {a.dqn_iters}"
        )
    missing = [m for m in ("matplotlib", "hydra") if importlib.util.find_spec(m) is None]
    if "matplotlib" in missing:
        p.error(f"--out: the plot needs matplotlib, which is not installed (got --out {a.out})")
    if a.dqn_iters and "hydra" in missing:
        p.error(f"--dqn-iters: the DQN part needs hydra-core (pass 0 to skip), got {a.dqn_iters}")
    return a


def main(argv: list[str]) -> None:
    """Run the latency benchmark (every rank); rank 0 prints the JSON line last."""
    a = parse_args(argv)
    cd.init_distributed()
    spec = cd.ExperienceSpec.from_batch(make_batch(1, 0))
    cpu = _measure("cpu", a, spec, None)
    off = _measure("offcpu", a, spec, cpu["compute_ms"])
    dqn = _dqn(a.dqn_iters) if a.dqn_iters else None
    if dist.get_rank() == 0:
        summary = report(cpu, off)
        if dqn:
            report_dqn(dqn, summary)
        rows = [
            {"learner": name, "put_kind": put, "mode": m, "items_per_iteration": r["items"][put]}
            | v
            for name, r in (("cpu", cpu), ("offcpu", off))
            for put, by_mode in r["median"].items()
            for m, v in by_mode.items()
        ]
        emit(
            "latency",
            rows,
            summary,
            batch=a.batch,
            item_bytes=spec.record_bytes,
            placement=a.placement,
            dqn=dqn,
            plot=a.out,
        )
        # the picture after the JSON: a plot that cannot be written costs no measurement
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        plot({"cpu": cpu["raw"], "offcpu": off["raw"]}, a.out)
    cd.destroy_distributed()


if __name__ == "__main__":
    main(__import__("sys").argv[1:])
