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
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import conduit_dist as cd
from conduit_dist.bench.common import emit, number, out_path

DQN_WARMUP = 20  # learning iterations of each DQN run left out of its medians
# put kind -> (donate=, the put kind whose calibration sizes the round). Each kind's round is sized
# to the learner's compute with its own put; "copying_same_volume" puts the donated volume with a
# copying put (the neutral comparison: the same bytes per iteration as "donated").
PUTS = {
    "donated": (True, "donated"),
    "copying": (False, "copying"),
    "copying_same_volume": (False, "donated"),
}
MODES = ("sync", "overlap")
OBS_BYTES = 4 * 84 * 84  # the learner reads its features from these


def _batch(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "obs": torch.randint(0, 256, (n, 4, 84, 84), dtype=torch.uint8, generator=g),
        "next_obs": torch.randint(0, 256, (n, 4, 84, 84), dtype=torch.uint8, generator=g),
        "action": torch.randint(0, 6, (n,), generator=g),
        "reward": torch.randn(n, generator=g),
        "done": torch.zeros(n, dtype=torch.bool),
    }


class Learner(nn.Module):
    """An MLP over the first ``features`` bytes of each observation."""

    def __init__(self, features: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.features = features
        dims = [features] + [hidden] * layers
        mods: list[nn.Module] = []
        for a, b in itertools.pairwise(dims):
            mods += [nn.Linear(a, b), nn.ReLU()]
        mods.append(nn.Linear(hidden, 6))
        self.net = nn.Sequential(*mods)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = obs.reshape(obs.shape[0], -1)[:, : self.features].float() / 255.0
        return self.net(x)


def _compute(model: nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> None:
    q = model(batch["obs"]).gather(1, batch["action"].view(-1, 1)).squeeze(1)
    loss = nn.functional.smooth_l1_loss(q, batch["reward"])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


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
    batches = [_batch(items, seed=rank * 100 + i) for i in range(2)]
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
        _compute(model, opt, batch)
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
    b = _batch(probe, seed=dist.get_rank())
    rounds, comp, empty = [], [], []
    for i in range(6):
        plane.put(b, donate=donate)
        t0 = time.perf_counter()
        batch = plane.fetch(batch_size)
        t1 = time.perf_counter()
        _compute(model, opt, batch)
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
    big = _batch(items, seed=dist.get_rank())
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


def _plot(results: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = [(put, mode) for put in PUTS for mode in MODES]
    fig, axes = plt.subplots(2, len(cols), figsize=(6 * len(cols), 7), sharey="row")
    for row, learner in enumerate(("cpu", "offcpu")):
        for col, (put, mode) in enumerate(cols):
            ax, r = axes[row][col], results[learner][put][mode]
            x = range(len(r["exposed"]))
            ax.bar(x, r["exposed"], color="tab:red", label="exposed (learner waits)")
            ax.bar(x, r["hidden"], bottom=r["exposed"], color="tab:green", label="hidden")
            ax.set_title(
                f"{learner}, {put} put, {mode}: median iteration "
                f"{statistics.median(r['iter']):.1f} ms"
            )
            ax.set_xlabel("iteration")
        axes[row][0].set_ylabel("experience path, ms")
    axes[0][-1].legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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


def _cuts(median: dict) -> dict[str, float]:
    """1 - overlap / sync of the exposed wait and the iteration, for one (learner, put kind)."""
    s, o = median["sync"], median["overlap"]
    return {
        "exposed_cut": 1 - o["exposed"] / s["exposed"],
        "iteration_cut": 1 - o["iter"] / s["iter"],
    }


class OffCpuLearner(nn.Module):
    """A small MLP whose backward also waits ``seconds``, host CPU idle (a device stand-in)."""

    def __init__(self, features: int, seconds: float) -> None:
        super().__init__()
        self.mlp = Learner(features, 256, 1)
        self.seconds = seconds

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return _DeviceTime.apply(self.mlp(obs), self.seconds)


class _DeviceTime(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


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


def _report(cpu: dict, off: dict) -> dict:
    """Print each setting's medians; the summary's cuts per put kind and learner."""
    summary: dict = {
        put: {"offcpu": _cuts(off["median"][put]), "cpu": _cuts(cpu["median"][put])} for put in PUTS
    }
    for name, r in (("cpu", cpu), ("offcpu", off)):
        for put in PUTS:
            for m in MODES:
                v = r["median"][put][m]
                print(
                    f"{name}_{put}_{m}: iteration {v['iter']:.1f} ms, exposed "
                    f"{v['exposed']:.2f} ms, hidden {v['hidden']:.2f} ms, put {v['put']:.2f} ms "
                    f"(items {r['items'][put]}, compute {r['compute_ms']:.1f} ms)"
                )
    for prefix, learner in (("", "cpu"), ("offcpu_", "offcpu")):  # the older keys: donated
        summary[f"{prefix}exposed_reduction"] = summary["donated"][learner]["exposed_cut"]
        summary[f"{prefix}iteration_reduction"] = summary["donated"][learner]["iteration_cut"]
    return summary


def _report_dqn(dqn: dict, summary: dict) -> None:
    for m in ("sync", "overlap", "auto"):
        d = dqn[m]
        print(f"dqn_{m}: iteration {d['iteration_ms']:.2f} ms, exposed {d['exposed_ms']:.3f}")
    sync = dqn["sync"]
    summary["dqn_exposed_reduction"] = 1 - dqn["overlap"]["exposed_ms"] / sync["exposed_ms"]
    summary["dqn_iteration_reduction"] = 1 - dqn["overlap"]["iteration_ms"] / sync["iteration_ms"]
    summary["dqn_auto_iteration_reduction"] = 1 - dqn["auto"]["iteration_ms"] / sync["iteration_ms"]


def main(argv: list[str]) -> None:
    """Run the latency benchmark (every rank); rank 0 prints the JSON line last."""
    a = parse_args(argv)
    cd.init_distributed()
    spec = cd.ExperienceSpec.from_batch(_batch(1, 0))
    cpu = _measure("cpu", a, spec, None)
    off = _measure("offcpu", a, spec, cpu["compute_ms"])
    dqn = _dqn(a.dqn_iters) if a.dqn_iters else None
    if dist.get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        _plot({"cpu": cpu["raw"], "offcpu": off["raw"]}, a.out)
        summary = _report(cpu, off)
        if dqn:
            _report_dqn(dqn, summary)
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
    cd.destroy_distributed()


if __name__ == "__main__":
    main(__import__("sys").argv[1:])
