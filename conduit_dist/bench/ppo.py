"""``torchrun --standalone --nproc_per_node=2 -m conduit_dist.bench ppo``: the PPO iteration with
its rollout moved synchronously vs hidden behind the minibatch backwards.

One run, the same workload in both modes, colocated ranks (each acts and learns):

- **rollout**: each rank puts ``--items`` Atari-like items (a 4x84x84 uint8 observation, action,
  log-probability, value, advantage, return: ~28 KB) per iteration; the plane's
  ``WithoutReplacement(epochs)`` sampler deals the global rollout out to the learners, each
  runs ``epochs x minibatches`` updates, then the rollout leaves the store.
- **learner**: the off-CPU learner of ``bench latency`` (a small MLP whose backward also waits
  ``--compute-ms`` with the host CPU idle: a device stand-in); ``--compute-ms 0`` sets it to the
  measured synchronous minibatch round, so the experience path is about half of the sync
  iteration.
- **modes**: ``sync`` (every minibatch's round runs inside its fetch: fully exposed) and
  ``overlap`` (``max_lag=0``, ``fetch(..., more=True)``: the next minibatch's round starts at
  this minibatch's backward). The first fetch of an iteration cannot be hidden in either (it
  ingests the rollout just put; nothing of the old policy's work is left to hide it behind).
- **shuffles**: ``global`` (the rollout is re-dealt every epoch: most rows cross ranks; the
  setting where moving data costs most) and ``local`` (each learner keeps its own part on its
  own shard: the neutral setting, almost nothing crosses a link).

Per iteration: time waited inside the fetches (exposed), the first fetch's share of it, and the
whole iteration. Modes alternate in blocks of iterations; medians; cuts = 1 - overlap / sync;
``exposed_cut_bound`` = 1 - (overlap's first fetch) / (sync exposed): the most any schedule
could cut while the first round stays exposed; ``hideable_cut``: the cut over the other fetches.
Since a put into a ``local`` plane writes straight into the shard's slots, the first round
ingests without copying. JSON line last.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import conduit_dist as cd
from conduit_dist.bench.common import emit, number
from conduit_dist.bench.latency import OffCpuLearner

MODES = ("sync", "overlap")
SHUFFLES = ("global", "local")


def _rollout(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "obs": torch.randint(0, 256, (n, 4, 84, 84), dtype=torch.uint8, generator=g),
        "action": torch.randint(0, 6, (n,), generator=g),
        "logp": torch.randn(n, generator=g),
        "value": torch.randn(n, generator=g),
        "adv": torch.randn(n, generator=g),
        "ret": torch.randn(n, generator=g),
    }


def _plane(spec, a, mode: str, shuffle: str) -> cd.DataPlane:
    return cd.DataPlane(
        spec,
        4 * a.items,
        seed=a.seed,
        sampler=cd.WithoutReplacement(epochs=a.epochs, shuffle=shuffle),
        placement="local",
        schedule=mode,
        max_lag=0,
        transport=cd.TransportConfig(bandwidth="declared"),
        max_policy_age=0,
    )


def _iteration(plane, model, opt, batch, a, mb: int) -> tuple[float, float, float]:
    """One PPO iteration; returns (exposed, iteration, the first fetch's exposed) ms."""
    dist.barrier()
    t0 = time.perf_counter()
    plane.put(batch)
    n, exposed = a.epochs * a.minibatches, 0.0
    for k in range(n):
        t1 = time.perf_counter()
        got = plane.fetch(mb, more=k < n - 1)
        exposed += time.perf_counter() - t1
        if k == 0:
            first = exposed
        out = model(got["obs"])
        loss = (out.sum(1) * got["adv"]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return exposed * 1e3, (time.perf_counter() - t0) * 1e3, first * 1e3


def _agree(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Options (checked before anything runs)."""
    p = argparse.ArgumentParser(prog="python -m conduit_dist.bench ppo", description=__doc__)
    p.add_argument("--items", type=number(int, 16), default=256, help="rollout items per rank")
    p.add_argument("--epochs", type=number(int, 1), default=4)
    p.add_argument("--minibatches", type=number(int, 1), default=4)
    p.add_argument("--iters", type=number(int, 2), default=12, help="iterations per mode")
    p.add_argument("--block", type=number(int, 1), default=3, help="iterations per block")
    p.add_argument(
        "--compute-ms", type=number(float, 0), default=0.0,
        help="backward's off-CPU wait (0: the measured sync minibatch round)",
    )  # fmt: skip
    p.add_argument("--seed", type=number(int, 0), default=0)
    a = p.parse_args(argv)
    if a.items % a.minibatches:
        p.error(f"--items: expected a multiple of --minibatches {a.minibatches}, got {a.items}")
    return a


def main(argv: list[str]) -> None:
    """Run both shuffles and modes; print the JSON line."""
    a = parse_args(argv)
    cd.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(a.seed)
    batch = _rollout(a.items, a.seed + rank)
    spec = cd.ExperienceSpec.from_batch(batch)
    mb = a.items // a.minibatches  # per learner: the global rollout over world learners
    results, summary = [], {}
    for shuffle in SHUFFLES:
        planes = {m: _plane(spec, a, m, shuffle) for m in MODES}
        compute = a.compute_ms
        if compute == 0:  # the sync minibatch round, measured with a no-wait learner
            probe = OffCpuLearner(512, 0.0)
            popt = torch.optim.SGD(probe.parameters(), lr=1e-3)
            exp = [_iteration(planes["sync"], probe, popt, batch, a, mb)[0] for _ in range(3)]
            compute = _agree(statistics.median(exp[1:]) / (a.epochs * a.minibatches))
        model = OffCpuLearner(512, compute / 1e3)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        samples = {m: {"exposed": [], "iteration": [], "first": []} for m in MODES}
        done = 0
        while done < a.iters:
            for m in MODES:
                if m == "overlap":  # the next minibatch's round starts at this backward
                    planes[m].attach(model)
                for i in range(a.block):
                    e, it, first = _iteration(planes[m], model, opt, batch, a, mb)
                    if done > 0 or i > 0:  # the first iteration of the run is warm-up
                        samples[m]["exposed"].append(e)
                        samples[m]["iteration"].append(it)
                        samples[m]["first"].append(first)
                if m == "overlap":
                    planes[m].detach()
            done += a.block
        for p in planes.values():
            p.close()
        med = {
            m: {k: _agree(statistics.median(v)) for k, v in s.items()} for m, s in samples.items()
        }
        cuts = {
            "exposed_cut": 1 - med["overlap"]["exposed"] / med["sync"]["exposed"],
            "iteration_cut": 1 - med["overlap"]["iteration"] / med["sync"]["iteration"],
            # the first fetch of an iteration cannot be hidden: the most overlap could cut
            "exposed_cut_bound": 1 - med["overlap"]["first"] / med["sync"]["exposed"],
            "hideable_cut": 1
            - (med["overlap"]["exposed"] - med["overlap"]["first"])
            / (med["sync"]["exposed"] - med["sync"]["first"]),
        }
        results.append({"shuffle": shuffle, "compute_ms": compute, "median_ms": med, **cuts})
        summary[shuffle] = {k: round(v, 3) for k, v in cuts.items()}
    if rank == 0:
        emit(
            "ppo", results, summary, world=world, items_per_rank=a.items,
            epochs=a.epochs, minibatches=a.minibatches, item_bytes=spec.record_bytes,
        )  # fmt: skip
    cd.destroy_distributed()
