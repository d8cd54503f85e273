"""``python -m conduit_dist.bench sim``: the simulator against real rounds here, then projected.

1. Validation: ``bench rounds`` runs under torchrun at each of ``--worlds`` (default 2, 3, 4 ranks
   on this machine's loopback), and the simulator predicts the same rounds (56-byte items padded
   to 64, 8 put and 128 fetched per rank; one-exchange, one-exchange with DQN's gradients,
   three-exchange) on the ``loopback`` topology with the model those rounds' planes use: this
   machine's, calibrated at their start-up (or loaded from ``--cache-dir`` when cached there).
   Error = predicted / measured - 1 on the round's wall time.
2. Projection: the workloads of ``conduit_dist.sim.project`` from 8 to 4,096 ranks on each of
   ``--topologies``, timed (``projection_s``), with the point where each round outgrows its
   backward and what the model says would move it.
3. Plots: ``--plot`` (default ``docs/img/sim_projection.png``).

Not yet: emulated hosts in the validation, the LLM-RL workload (token plane).

The JSON line's ``summary``: ``median_error``, ``worst_error`` (absolute, over the validation
rounds), ``projection_s``, ``crossovers`` (per topology and workload).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from conduit_dist.bench.common import emit, number, out_path
from conduit_dist.sim import Workload, load, names, simulate
from conduit_dist.sim.project import plot, project

ROUND_CASES = {  # bench rounds' cases as workloads (its records are 64 bytes on the wire)
    "fused": {"placement": "local"},
    "fused_grads": {"placement": "local", "reduce_numel": 17_282},
    "three_exchange": {"placement": "round_robin"},
}


def _measure(world: int, samples: int, cache_dir: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={world}", "-m", "conduit_dist.bench", "rounds",
           "--samples", str(samples), "--warmup", "50", "--alloc-rounds", "2",
           "--bandwidth", "calibrate", "--bandwidth-cache", cache_dir]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"bench rounds at {world} ranks failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def validate(worlds: list[int], samples: int, cache_dir: str) -> list[dict]:
    """Measured against predicted round times at each world size (the rounds' planes calibrate
    the model, or load it from ``cache_dir``; the simulator prices with that same model)."""
    topo = load("loopback")
    out = []
    for world in worlds:
        measured = _measure(world, samples, cache_dir)
        model = topo.model(world, cache_dir)
        for r in measured["results"]:
            w = Workload(r["case"], record_bytes=64, puts_per_rank=measured["put"],
                         batch_per_learner=measured["batch"], **ROUND_CASES[r["case"]])  # fmt: skip
            sim = simulate(topo, world, w, model=model)
            out.append({
                "world": world, "case": r["case"], "measured_ms": r["round_ms"],
                "raw_ms": r["raw_ms"], "predicted_ms": sim.seconds * 1e3,
                "error": sim.seconds * 1e3 / r["round_ms"] - 1,
            })  # fmt: skip
    return out


def main(argv: list[str]) -> None:
    """Run the validation and the projection; print the JSON line last."""
    p = argparse.ArgumentParser(prog="python -m conduit_dist.bench sim")
    p.add_argument("--worlds", nargs="+", type=number(int, 2), default=[2, 3, 4])
    p.add_argument("--samples", type=number(int, 10), default=300, help="rounds per case")
    p.add_argument("--topologies", nargs="+", choices=names(),
                   default=["dgx_h100", "frontier_mi250x"])  # fmt: skip
    p.add_argument("--plot", type=out_path(".png"), default="docs/img/sim_projection.png")
    p.add_argument("--no-validation", action="store_true", help="the projection only")
    p.add_argument("--cache-dir", default="~/.cache/conduit_dist", help="calibration cache")
    a = p.parse_args(argv)
    checks = [] if a.no_validation else validate(a.worlds, a.samples, a.cache_dir)
    for c in checks:
        print(f"{c['world']} ranks {c['case']:>15}: measured {c['measured_ms']:.3f} ms, "
              f"predicted {c['predicted_ms']:.3f} ms ({c['error']:+.0%})", flush=True)  # fmt: skip
    t0 = time.perf_counter()
    rows, crossovers = [], {}
    for name in a.topologies:
        got, cross = project(load(name))
        rows += got
        crossovers[name] = cross
    projection_s = time.perf_counter() - t0
    plot(rows, a.plot)
    for name, cross in crossovers.items():
        for c in cross:
            print(f"{name} {c['workload']}: round > backward from {c['world']} ranks; "
                  f"faster placement {c.get('faster_placement')}, dominant "
                  f"{c.get('dominant')}", flush=True)  # fmt: skip
    errors = [abs(c["error"]) for c in checks]
    summary = {
        "median_error": statistics.median(errors) if errors else None,
        "worst_error": max(errors) if errors else None,
        "projection_s": projection_s,
        "crossovers": crossovers,
        "plot": a.plot,
    }
    emit("sim", checks, summary, worlds=a.worlds, topologies=a.topologies, projection=rows)
