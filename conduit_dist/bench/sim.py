"""``python -m conduit_dist.bench sim``: the simulator against real rounds here, then projected.

1. Validation, out of sample (:mod:`conduit_dist.bench.sim_validate`): ``bench rounds`` jobs
   under torchrun (56-byte items padded to 64, 8 put and 128 fetched per rank; one-exchange,
   one-exchange with DQN's gradients, three-exchange), each job calibrating the plane's
   collective model afresh at start-up (a cache directory of its own). The configurations:
   ``--worlds`` ranks on this machine's loopback, and two emulated hosts of each of
   ``--host-ranks`` ranks (network namespaces, the veth link shaped to each of
   ``--host-rates`` Mbit/s; skipped, and said so, where namespaces cannot be made). Those with
   at most one rank per core are the scored set, each run ``--repeats`` times (passes over the
   set); the oversubscribed ones run once, reported beside them, not scored. Every scored run
   is predicted with another job's calibration and bookkeeping terms pooled (medians) over the
   other configurations' runs (``calibration_source``, ``fit_sources`` in each check). Error =
   predicted / measured - 1 on the round's wall time and, for the one-exchange rounds, on the
   latency a round started by ``fetch_start`` at a 1 ms backward leaves exposed (the sim's
   ``flight`` overlap); ``collectives_error`` the same for the exchanges alone against the raw
   calls ``bench rounds`` replays.
2. Projection: the workloads of ``conduit_dist.sim.project`` (DQN-, Atari-, PPO-like, LLM RL
   of 1B/8B/70B) from 8 to 4,096 ranks on each of ``--topologies``, timed (``projection_s``),
   with the point where each round outgrows its backward and what the model says would move it.
3. The picture: ``sim_projection.png`` in ``--out-dir`` (default ``bench_out`` under the
   working directory; ``--out-dir docs/img`` from the checkout refreshes the docs' picture),
   drawn after the JSON line is printed.

The JSON line's ``summary`` (:func:`~conduit_dist.bench.sim_validate.summarize`):
``median_error_out_of_sample``, ``worst_error_out_of_sample`` (absolute, over the scored
rounds and exposed latencies), ``median_round_error_out_of_sample``,
``median_exposed_error_out_of_sample``, ``median_collectives_error_out_of_sample``,
``scored_set``, ``scored_checks``; ``median_error_in_sample`` / ``worst_error_in_sample`` (the
same checks, each predicted with its own run's calibration and fit: how this bench scored
before); ``oversubscribed_set`` with ``median_error_oversubscribed`` /
``worst_error_oversubscribed``; ``bookkeeping_fits`` (every run's), ``cores``,
``emulated_hosts`` (``ran``, ``not asked`` or why skipped), ``projection_s``, ``crossovers``
(per topology and workload), ``plot``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

from conduit_dist.bench.common import check_out_path, emit, number
from conduit_dist.bench.hosts import EmulatedHosts, HostsUnavailable
from conduit_dist.bench.sim_validate import (
    BACKWARD_MS,
    ROUND_CASES,
    Config,
    Run,
    fit_bookkeeping,
    score,
    summarize,
)
from conduit_dist.sim import load, names
from conduit_dist.sim.project import plot, project

__all__ = ["fit_bookkeeping", "main"]
PICTURE = "sim_projection.png"


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


def _measure(cfg: Config, job: int, samples: int, cache_dir: str) -> Run:
    """Job ``job`` of ``bench rounds`` in ``cfg``, its planes calibrating into ``cache_dir``.

    Raises:
        HostsUnavailable: emulated hosts where namespaces cannot be made.
        RuntimeError: a job that fails (with the end of its output).
    """
    if cfg.hosts == 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={cfg.world}", *_rounds_args(samples, cache_dir)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"bench rounds, {cfg.label}, failed:\n{proc.stderr[-2000:]}")
        return Run(cfg, job, _last_json(proc.stdout), cache_dir)
    with EmulatedHosts(cfg.rate_mbit) as hosts, tempfile.TemporaryDirectory() as logs:
        outs = hosts.launch(_rounds_args(samples, cache_dir), cfg.ranks_per_host, logs,
                            timeout_s=900)  # fmt: skip
        keys = tuple(hosts.host_keys(cfg.ranks_per_host))
    return Run(cfg, job, _last_json(outs[0]), cache_dir, keys)


def configs(worlds: list[int], host_ranks: list[int], rates: list[float]) -> list[Config]:
    """The configurations to measure: loopback first, then emulated hosts by rate."""
    loop = [Config(1, w) for w in worlds]
    return loop + [Config(2, n, rate) for rate in rates for n in host_ranks]


def measure(
    cfgs: list[Config], repeats: int, samples: int, cache_root: str, cores: int
) -> tuple[list[Run], str | None]:
    """``repeats`` passes over the scored configurations (at most one rank per core), then one
    run of each oversubscribed one; each job calibrates afresh in a directory of its own under
    ``cache_root``.

    Returns:
        ``(runs, hosts_skipped)``: the runs in the order measured, and why the emulated hosts
        were skipped (``None`` if they ran or none were asked).
    """
    scored = [c for c in cfgs if c.scored(cores)]
    plan = [(c, j) for j in range(repeats) for c in scored]
    plan += [(c, 0) for c in cfgs if not c.scored(cores)]
    runs, skipped = [], None
    for cfg, job in plan:
        if cfg.hosts > 1 and skipped:
            continue
        slug = cfg.label.replace(" ", "").replace(",", "-").replace("/", "")
        cache_dir = os.path.join(cache_root, f"{slug}-job{job}")
        # calibrated afresh: a cache left by an earlier invocation (--cache-dir kept) would make
        # this job's model an older job's, which the out-of-sample sources do not name
        shutil.rmtree(cache_dir, ignore_errors=True)
        try:
            load = os.getloadavg()[0]  # what else this machine ran as the job started
            runs.append(replace(_measure(cfg, job, samples, cache_dir), load_1m=load))
        except HostsUnavailable as exc:
            skipped = str(exc)
            continue
        print(f"measured {runs[-1].name} (load {load:.1f})", file=sys.stderr, flush=True)
    return runs, skipped


def _out_dir(text: str) -> str:
    """``--out-dir``: a directory the picture can be written in (checked before anything runs)."""
    check_out_path(os.path.join(text, PICTURE), (".png",))
    return text


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m conduit_dist.bench sim")
    p.add_argument("--worlds", nargs="+", type=number(int, 2), default=[2, 3, 4],
                   help="ranks on this machine's loopback")  # fmt: skip
    p.add_argument("--host-ranks", nargs="+", type=number(int, 1), default=[1, 2],
                   help="ranks on each of the two emulated hosts")  # fmt: skip
    p.add_argument("--host-rates", nargs="*", type=number(float, 1.0), default=[2000.0, 500.0],
                   help="Mbit/s of the emulated hosts' link (none: loopback only)")  # fmt: skip
    p.add_argument("--repeats", type=number(int, 2), default=2,
                   help="jobs per scored configuration (each predicted from others')")  # fmt: skip
    p.add_argument("--samples", type=number(int, 10), default=300, help="rounds per case")
    p.add_argument("--topologies", nargs="+", choices=names(),
                   default=["dgx_h100", "frontier_mi250x"])  # fmt: skip
    p.add_argument("--out-dir", type=_out_dir, default="bench_out",
                   help=f"where the picture ({PICTURE}) goes")  # fmt: skip
    p.add_argument("--no-validation", action="store_true", help="the projection only")
    p.add_argument("--cache-dir", default=None,
                   help="where each job's calibration is kept, a directory per job, emptied "
                        "when its job starts (default: a temporary one)")  # fmt: skip
    a = p.parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:
        p.error(f"--out-dir: the picture needs matplotlib, which is not installed "
                f"(got --out-dir {a.out_dir})")  # fmt: skip
    return a


def _print(checks: list[dict], skipped: str | None) -> None:
    if skipped:
        print(f"emulated hosts skipped: {skipped}", flush=True)
    for c in checks:
        tag = "scored" if c["scored"] else "not scored"
        line = (f"{c['where']:>28} job {c['job']} {c['case']:>15} {c['metric']:>7}: "
                f"measured {c['measured_ms']:.3f} ms, predicted {c['predicted_ms']:.3f} ms "
                f"({c['error']:+.0%}, {tag})")  # fmt: skip
        if c["metric"] == "round":
            line += (f"; collectives {c['raw_ms']:.3f} vs {c['collectives_ms']:.3f} ms "
                     f"({c['collectives_error']:+.0%})")  # fmt: skip
        print(line, flush=True)


def main(argv: list[str]) -> None:
    """Run the validation and the projection; print the JSON line, then draw the picture."""
    a = _parse(argv)
    cores = os.cpu_count() or 1
    checks, fits, skipped = [], {}, None
    cfgs = configs(a.worlds, a.host_ranks, a.host_rates)
    if not a.no_validation:
        with tempfile.TemporaryDirectory() as fresh:
            cache_root = os.path.expanduser(a.cache_dir) if a.cache_dir else fresh
            runs, skipped = measure(cfgs, a.repeats, a.samples, cache_root, cores)
            checks, fits = score(runs, load("loopback"), cores)
    _print(checks, skipped)
    t0 = time.perf_counter()
    rows, crossovers = [], {}
    for name in a.topologies:
        got, cross = project(load(name))
        rows += got
        crossovers[name] = cross
    projection_s = time.perf_counter() - t0
    for name, cross in crossovers.items():
        for c in cross:
            print(f"{name} {c['workload']}: round > backward from {c['world']} ranks; "
                  f"faster with {c.get('faster')}, dominant "
                  f"{c.get('dominant')}", flush=True)  # fmt: skip
    picture = os.path.join(a.out_dir, PICTURE)
    hosts_asked = any(c.hosts > 1 for c in cfgs) and not a.no_validation
    summary = summarize(checks) | {
        "cores": cores,
        "bookkeeping_fits": fits,
        "emulated_hosts": skipped or ("ran" if hosts_asked else "not asked"),
        "projection_s": projection_s,
        "crossovers": crossovers,
        "plot": picture,
    }
    emit("sim", checks, summary, worlds=a.worlds, host_ranks=a.host_ranks,
         host_rates=a.host_rates, repeats=a.repeats, topologies=a.topologies,
         backward_ms=BACKWARD_MS, projection=rows)  # fmt: skip
    os.makedirs(a.out_dir, exist_ok=True)  # the JSON is out: a picture that fails loses nothing
    plot(rows, picture)
