"""``python -m conduit_dist.bench sim``: the simulator against real rounds here, then projected.

1. Validation: ``bench rounds`` runs under torchrun (56-byte items padded to 64, 8 put and 128
   fetched per rank; one-exchange, one-exchange with DQN's gradients, three-exchange):
   first once at 2 ranks to fit the bookkeeping terms (:func:`fit_bookkeeping`: each case's
   round over its raw collectives), then afresh at each of ``--worlds`` (default 2, 3, 4 ranks
   on this machine's loopback) and on two emulated hosts of two ranks (network namespaces, the
   veth link shaped to each of ``--host-rates`` Mbit/s; skipped, and said so, where namespaces
   cannot be made). The simulator predicts each run on the ``loopback`` topology (3 and 4 ranks
   oversubscribe its cores; the emulated hosts share them) with the model that run's planes
   calibrated at start-up, in a fresh cache unless ``--cache-dir`` names one. Error =
   predicted / measured - 1 on the round's wall time and, for the one-exchange rounds, on the
   latency a round started by ``fetch_start`` at a 1 ms backward leaves exposed (the sim's
   ``flight`` overlap); ``collectives_error`` the same for the exchanges alone against the raw
   calls ``bench rounds`` replays.
2. Projection: the workloads of ``conduit_dist.sim.project`` (DQN-, Atari-, PPO-like, LLM RL
   of 1B/8B/70B) from 8 to 4,096 ranks on each of ``--topologies``, timed (``projection_s``),
   with the point where each round outgrows its backward and what the model says would move it.
3. Plots: ``--plot`` (default ``docs/img/sim_projection.png``).

The JSON line's ``summary``: ``median_error``, ``worst_error`` (absolute, over the validation
rounds and exposed latencies), the same ``_held_out`` (without the 2-rank loopback run, whose
configuration the bookkeeping was fitted on), ``median_collectives_error``,
``median_exposed_error``,
``bookkeeping_fit``, ``emulated_hosts`` (``ran``, ``not asked`` or why skipped),
``projection_s``, ``crossovers`` (per topology and workload).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

from conduit_dist.bench.common import emit, number, out_path
from conduit_dist.bench.hosts import EmulatedHosts, HostsUnavailable
from conduit_dist.bench.rounds import GRAD_NUMEL
from conduit_dist.errors import ConfigError
from conduit_dist.sim import SimTopology, Workload, load, names, simulate
from conduit_dist.sim.project import plot, project

ROUND_CASES = {  # bench rounds' cases as workloads (its records are 64 bytes on the wire)
    "fused": {"placement": "local"},
    "fused_grads": {"placement": "local", "reduce_numel": GRAD_NUMEL},
    "three_exchange": {"placement": "round_robin"},
}


BACKWARD_MS = 1.0  # the backward the exposed-latency runs start their rounds at


def _rounds_args(samples: int, cache_dir: str) -> list[str]:
    args = f"-m conduit_dist.bench rounds --samples {samples} --warmup 50 --alloc-rounds 2"
    args += " --cases " + " ".join(ROUND_CASES)  # the cases the simulator models
    args += f" --backward-ms {BACKWARD_MS}"
    # the simulator prices gloo's collectives (shared memory is not modelled): rounds over gloo
    return [*args.split(), "--bandwidth", "calibrate", "--bandwidth-cache", cache_dir,
            "--shared-memory", "false"]  # fmt: skip


def _last_json(text: str) -> dict:
    """The benchmark's JSON line: the last line that parses as one (a host's log also holds
    torchrun's and the ranks' own messages, some printed after it)."""
    for line in reversed(text.strip().splitlines()):
        with contextlib.suppress(ValueError):
            got = json.loads(line)
            if isinstance(got, dict) and "bench" in got:
                return got
    raise RuntimeError(f"bench rounds printed no JSON line; its output ends:\n{text[-2000:]}")


def _measure(world: int, samples: int, cache_dir: str) -> dict:
    """``bench rounds`` at ``world`` ranks on this machine's loopback."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={world}", *_rounds_args(samples, cache_dir)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"bench rounds at {world} ranks failed:\n{proc.stderr[-2000:]}")
    return _last_json(proc.stdout)


def _measure_hosts(rate_mbit: float, samples: int, cache_dir: str) -> tuple[dict, list[str]]:
    """``bench rounds`` on two emulated hosts of two ranks, the link shaped to ``rate_mbit``;
    the result and every rank's host key (the calibration's layout)."""
    with EmulatedHosts(rate_mbit) as hosts, tempfile.TemporaryDirectory() as logs:
        outs = hosts.launch(_rounds_args(samples, cache_dir), 2, logs, timeout_s=900)
        return _last_json(outs[0]), hosts.host_keys(2)


def fit_bookkeeping(measured: dict, topo: SimTopology | None = None) -> dict[str, float]:
    """The topology's bookkeeping terms from one ``bench rounds`` run: each case's round time
    over its raw collectives' (``round_cpu_us`` the fused round's; ``exchange_cpu_us`` each of
    the three-exchange round's two further exchanges; ``payload_gbps`` the gradients' extra),
    undoing ``topo``'s oversubscription at the run's world size (the inverse of
    :func:`~conduit_dist.sim.rounds.bookkeeping_s`).

    Raises:
        ConfigError: a run without one of the cases of :data:`ROUND_CASES`.
    """
    stretch = topo.oversubscription(measured["world"]) if topo is not None else 1.0
    extra = {
        r["case"]: max(0.0, r["round_ms"] - r["raw_ms"]) * 1e3 / stretch
        for r in measured["results"]
    }
    missing = sorted(set(ROUND_CASES) - set(extra))
    if missing:
        raise ConfigError(
            f"bench rounds results: expected cases {sorted(ROUND_CASES)}, missing {missing}"
        )
    base = extra["fused"]
    grads_us = extra["fused_grads"] - base
    return {
        "round_cpu_us": base,
        "exchange_cpu_us": max(0.0, (extra["three_exchange"] - base) / 2),
        "payload_gbps": GRAD_NUMEL * 4 / (grads_us * 1e3) if grads_us > 0 else 0.0,
    }


def _checks(topo: SimTopology, measured: dict, model, where: str) -> list[dict]:
    """Each case's round time, and its exposed latency where measured, against the sim's."""
    out = []
    for r in measured["results"]:
        w = Workload(r["case"], record_bytes=64, puts_per_rank=measured["put"],
                     batch_per_learner=measured["batch"], backward_ms=BACKWARD_MS,
                     overlap="flight", **ROUND_CASES[r["case"]])  # fmt: skip
        sim = simulate(topo, measured["world"], w, model=model)
        coll = sim.seconds - sim.cpu_s
        row = {"where": where, "world": measured["world"], "case": r["case"]}
        out.append(row | {
            "metric": "round", "measured_ms": r["round_ms"], "predicted_ms": sim.seconds * 1e3,
            "error": sim.seconds * 1e3 / r["round_ms"] - 1,
            "raw_ms": r["raw_ms"], "collectives_ms": coll * 1e3,
            "collectives_error": coll * 1e3 / r["raw_ms"] - 1,
            "bookkeeping_ms": r["round_ms"] - r["raw_ms"],
            "bookkeeping_predicted_ms": sim.cpu_s * 1e3,
            "strategies": [e.strategy for e in sim.exchanges],
        })  # fmt: skip
        if r.get("exposed_ms"):  # started by fetch_start, a backward of BACKWARD_MS
            out.append(row | {
                "metric": "exposed", "backward_ms": BACKWARD_MS,
                "measured_ms": r["exposed_ms"], "predicted_ms": sim.exposed_s * 1e3,
                "error": sim.exposed_s * 1e3 / r["exposed_ms"] - 1,
            })  # fmt: skip
    return out


def validate(
    worlds: list[int], samples: int, cache_dir: str, host_rates: list[float]
) -> tuple[list[dict], dict[str, float], str | None]:
    """Measured against predicted rounds.

    First a fitting run at 2 ranks gives the bookkeeping terms (:func:`fit_bookkeeping`); then
    fresh runs at each of ``worlds`` on loopback, and on two emulated hosts of two ranks at each
    of ``host_rates`` (Mbit/s), are predicted with them, with each run's own calibrated model
    (the rounds' planes calibrate it, or load it from ``cache_dir``).

    Returns:
        ``(checks, bookkeeping, hosts_skipped)``: a row per run and case, the fitted terms, and
        why the emulated hosts were skipped (``None`` if they ran).
    """
    loopback = load("loopback")
    fit = fit_bookkeeping(_measure(2, samples, cache_dir), loopback)
    topo = replace(loopback, **fit)
    out = []
    for world in worlds:
        measured = _measure(world, samples, cache_dir)
        out += _checks(topo, measured, topo.model(world, cache_dir), "loopback")
    skipped = None
    cores = max(1, (os.cpu_count() or 1) // 2)  # the two hosts share this machine's cores
    two = replace(topo, ranks_per_node=2, cores_per_node=cores)
    for rate in host_rates:
        rate_dir = os.path.join(cache_dir, f"hosts-{rate:g}mbit")  # one calibration per rate
        try:
            measured, keys = _measure_hosts(rate, samples, rate_dir)
        except HostsUnavailable as exc:
            skipped = str(exc)
            break
        out += _checks(two, measured, two.model(4, rate_dir, keys), f"2 hosts, {rate:g} Mbit/s")
    return out, fit, skipped


def main(argv: list[str]) -> None:
    """Run the validation and the projection; print the JSON line last."""
    p = argparse.ArgumentParser(prog="python -m conduit_dist.bench sim")
    p.add_argument("--worlds", nargs="+", type=number(int, 2), default=[2, 3, 4])
    p.add_argument("--samples", type=number(int, 10), default=300, help="rounds per case")
    p.add_argument("--topologies", nargs="+", choices=names(),
                   default=["dgx_h100", "frontier_mi250x"])  # fmt: skip
    p.add_argument("--plot", type=out_path(".png"), default="docs/img/sim_projection.png")
    p.add_argument("--no-validation", action="store_true", help="the projection only")
    p.add_argument("--host-rates", nargs="*", type=number(float, 1.0), default=[2000.0, 500.0],
                   help="Mbit/s of the emulated hosts' link (none: loopback only)")  # fmt: skip
    p.add_argument("--cache-dir", default=None,
                   help="calibration cache (default: a fresh one each run calibrates)")  # fmt: skip
    a = p.parse_args(argv)
    checks, fit, skipped = [], {}, None
    if not a.no_validation:
        with tempfile.TemporaryDirectory() as fresh:
            cache_dir = os.path.expanduser(a.cache_dir) if a.cache_dir else fresh
            checks, fit, skipped = validate(a.worlds, a.samples, cache_dir, a.host_rates)
    if skipped:
        print(f"emulated hosts skipped: {skipped}", flush=True)
    for c in checks:
        line = (f"{c['where']:>22} {c['world']} ranks {c['case']:>15} {c['metric']:>7}: "
                f"measured {c['measured_ms']:.3f} ms, predicted {c['predicted_ms']:.3f} ms "
                f"({c['error']:+.0%})")  # fmt: skip
        if c["metric"] == "round":
            line += (f"; collectives {c['raw_ms']:.3f} vs {c['collectives_ms']:.3f} ms "
                     f"({c['collectives_error']:+.0%})")  # fmt: skip
        print(line, flush=True)
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
                  f"faster with {c.get('faster')}, dominant "
                  f"{c.get('dominant')}", flush=True)  # fmt: skip
    errors = [abs(c["error"]) for c in checks]
    # the runs the bookkeeping was not fitted on (the fit ran at 2 ranks on loopback)
    held = [abs(c["error"]) for c in checks if (c["where"], c["world"]) != ("loopback", 2)]
    coll = [abs(c["collectives_error"]) for c in checks if c["metric"] == "round"]
    exposed = [abs(c["error"]) for c in checks if c["metric"] == "exposed"]
    summary = {
        "median_error": statistics.median(errors) if errors else None,
        "worst_error": max(errors) if errors else None,
        "median_error_held_out": statistics.median(held) if held else None,
        "worst_error_held_out": max(held) if held else None,
        "median_collectives_error": statistics.median(coll) if coll else None,
        "median_exposed_error": statistics.median(exposed) if exposed else None,
        "bookkeeping_fit": fit,
        "emulated_hosts": skipped or ("ran" if checks and a.host_rates else "not asked"),
        "projection_s": projection_s,
        "crossovers": crossovers,
        "plot": a.plot,
    }
    emit("sim", checks, summary, worlds=a.worlds, host_rates=a.host_rates,
         topologies=a.topologies, projection=rows)  # fmt: skip
