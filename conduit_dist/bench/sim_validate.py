"""``bench sim``'s validation, checked out of sample: which run predicts which, and the errors.

Each measured run is a ``bench rounds`` job (:data:`ROUND_CASES`) in one configuration
(:class:`Config`: ranks on this machine's loopback, or emulated hosts), with a calibration of
the plane's collective model of its own (its planes calibrate at start-up into a cache
directory of the job's own). A run is predicted from two things, each taken from another run
(:func:`sources`):

- the collective model: the calibration another job of the same configuration made (a model is
  keyed by its layout, so it must be the same layout, but it is another job's measurement);
- the bookkeeping terms (:func:`pool_bookkeeping`): each term the median over every scored run
  of the other configurations (other layouts or world sizes, one rank per core, every pass),
  or, where no other configuration ran, over the other jobs of its own (the sources name
  which). A median over runs, not one run's fit: a term is a difference of two medians within
  a run (the gradients' ~0.1 ms within a ~0.7 ms round), and one slow case in one fitting run
  would otherwise price every run it predicts.

The scored set is the configurations with at most one rank per core of this machine (2 ranks
on a 2-core loopback; 2 emulated hosts of 1 rank). Oversubscribed configurations (more ranks
than cores: their bookkeeping stretched by the cores they share) are reported beside them and
not scored, predicted with their own calibration (in sample, named so) and the scored runs'
pooled fit.
For the scored runs, the in-sample prediction (own calibration, own fit: how ``bench sim``
scored before) is kept beside each check as ``error_in_sample``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from conduit_dist.bench.rounds import GRAD_NUMEL
from conduit_dist.errors import ConfigError
from conduit_dist.sim import SimTopology, Workload, simulate

ROUND_CASES = {  # bench rounds' cases as workloads (its records are 64 bytes on the wire)
    "fused": {"placement": "local"},
    "fused_grads": {"placement": "local", "reduce_numel": GRAD_NUMEL},
    "three_exchange": {"placement": "round_robin"},
}
BACKWARD_MS = 1.0  # the backward the exposed-latency runs start their rounds at
TERMS = ("round_cpu_us", "exchange_cpu_us", "payload_gbps")


@dataclass(frozen=True)
class Config:
    """Where a run's ranks are: ``hosts`` 1 (this machine's loopback) or emulated hosts of
    ``ranks_per_host`` ranks each, their link shaped to ``rate_mbit`` Mbit/s (``None``:
    unshaped)."""

    hosts: int
    ranks_per_host: int
    rate_mbit: float | None = None

    @property
    def world(self) -> int:
        return self.hosts * self.ranks_per_host

    @property
    def label(self) -> str:
        if self.hosts == 1:
            return f"loopback, {self.world} ranks"
        rate = f", {self.rate_mbit:g} Mbit/s" if self.rate_mbit else ""
        s = "" if self.ranks_per_host == 1 else "s"
        return f"{self.hosts} hosts x {self.ranks_per_host} rank{s}{rate}"

    def scored(self, cores: int) -> bool:
        """At most one rank per core of this machine (every emulated host shares its cores)."""
        return self.world <= cores

    def topology(self, loopback: SimTopology, cores: int) -> SimTopology:
        """The simulated machine: ``loopback``'s terms, a node per host, the cores shared."""
        if self.hosts == 1:
            return replace(loopback, cores_per_node=cores)
        per_host = max(1, cores // self.hosts)
        return replace(loopback, ranks_per_node=self.ranks_per_host, cores_per_node=per_host)


@dataclass(frozen=True, eq=False)
class Run:
    """One measured ``bench rounds`` job.

    Attributes:
        config: where its ranks ran.
        job: its index among the jobs of ``config``.
        measured: ``bench rounds``' JSON line.
        cache_dir: where its planes cached the calibration they made at start-up.
        host_keys: every rank's host key (emulated hosts; ``None``: one torchrun node here).
        load_1m: this machine's 1-minute load average as the job started (the context its
            timings were taken in; ``None``: not recorded).
    """

    config: Config
    job: int
    measured: dict
    cache_dir: str
    host_keys: tuple[str, ...] | None = None
    load_1m: float | None = None

    @property
    def name(self) -> str:
        return f"{self.config.label}, job {self.job}"

    def model(self, topo: SimTopology):
        """The collective model this job's planes calibrated."""
        keys = list(self.host_keys) if self.host_keys else None
        return topo.model(self.config.world, self.cache_dir, keys)


def increments(measured: dict, topo: SimTopology | None = None) -> dict[str, float]:
    """One ``bench rounds`` run's bookkeeping increments, microseconds, unclipped: each case's
    round time over its raw collectives' (``round_cpu_us`` the fused round's;
    ``exchange_cpu_us`` each of the three-exchange round's two further exchanges over it;
    ``payload_us`` the gradients' case over it), undoing ``topo``'s oversubscription at the
    run's world size (the inverse of :func:`~conduit_dist.sim.rounds.bookkeeping_s`).

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
    return {
        "round_cpu_us": base,
        "exchange_cpu_us": (extra["three_exchange"] - base) / 2,
        "payload_us": extra["fused_grads"] - base,
    }


def pool_bookkeeping(runs: list[dict[str, float]]) -> dict[str, float]:
    """The topology's bookkeeping terms (:data:`TERMS`) from runs' :func:`increments`: each
    the median over the runs, clipped at 0; ``payload_gbps`` the gradients' bytes over the
    median ``payload_us`` (0, free, where that is not positive). A median over increments, not
    over rates: a payload that costs nothing within the noise is 0 us, not an infinite rate.

    Raises:
        ConfigError: no runs.
    """
    if not runs:
        raise ConfigError("pool_bookkeeping: expected at least one run's increments, got none")
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    pay = med["payload_us"]
    return {
        "round_cpu_us": max(0.0, med["round_cpu_us"]),
        "exchange_cpu_us": max(0.0, med["exchange_cpu_us"]),
        "payload_gbps": GRAD_NUMEL * 4 / (pay * 1e3) if pay > 0 else 0.0,
    }


def fit_bookkeeping(measured: dict, topo: SimTopology | None = None) -> dict[str, float]:
    """The topology's bookkeeping terms (:data:`TERMS`) from one ``bench rounds`` run: its
    :func:`increments`, pooled alone.

    Raises:
        ConfigError: a run without one of the cases of :data:`ROUND_CASES`.
    """
    return pool_bookkeeping([increments(measured, topo)])


def sources(runs: list[Run], cores: int) -> dict[Run, tuple[Run, tuple[Run, ...]]]:
    """Each run's ``(calibration run, fit runs)``.

    A scored run (:meth:`Config.scored`) of job ``j`` takes its calibration from job ``j + 1``
    (cyclically) of its own configuration, and its bookkeeping fit from every scored run of the
    other configurations (the other jobs of its own where no other ran): never its own run. An
    oversubscribed run takes its own calibration and every scored run's fit (its own where
    none ran).

    Example: loopback and one host rate, two jobs each; loopback job 0 is predicted with
    loopback job 1's calibration and the median of the hosts' jobs 0 and 1, the hosts' job 0
    with hosts job 1's calibration and the median of loopback's jobs 0 and 1.

    Raises:
        ConfigError: a scored configuration with a single job (its calibration would be its own).
    """
    scored = [r for r in runs if r.config.scored(cores)]
    jobs: dict[Config, list[Run]] = {}
    for r in scored:
        jobs.setdefault(r.config, []).append(r)
    lonely = [c.label for c, js in jobs.items() if len(js) < 2]
    if lonely:
        raise ConfigError(
            f"scored configurations {lonely}: expected >= 2 jobs each (a run is predicted with "
            "another job's calibration), got 1"
        )
    out = {}
    for r in runs:
        if r.config not in jobs:  # oversubscribed: reported beside, not scored
            out[r] = (r, tuple(scored) or (r,))
            continue
        same = jobs[r.config]
        calib = same[(same.index(r) + 1) % len(same)]
        other = tuple(o for o in scored if o.config != r.config)
        out[r] = (calib, other or tuple(o for o in same if o is not r))
    return out


def _increments(run: Run, loopback: SimTopology, cores: int) -> dict[str, float]:
    return increments(run.measured, run.config.topology(loopback, cores))


def _predict(topo: SimTopology, measured: dict, model) -> list[dict]:
    """Each case's round time, and its exposed latency where measured, against the sim's."""
    out = []
    for r in measured["results"]:
        w = Workload(r["case"], record_bytes=64, puts_per_rank=measured["put"],
                     batch_per_learner=measured["batch"], backward_ms=BACKWARD_MS,
                     overlap="flight", **ROUND_CASES[r["case"]])  # fmt: skip
        sim = simulate(topo, measured["world"], w, model=model)
        coll = sim.seconds - sim.cpu_s
        row = {"world": measured["world"], "case": r["case"]}
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


def score(runs: list[Run], loopback: SimTopology, cores: int) -> tuple[list[dict], dict]:
    """Every run's checks, predicted from the runs :func:`sources` names.

    Returns:
        ``(checks, fits)``: a row per run, case and metric (``where``, ``job``, ``scored``,
        ``calibration_source``, ``fit_sources`` (the runs pooled), ``bookkeeping_fit`` (the
        pooled terms), the errors; for scored runs ``error_in_sample``), and every run's own
        fitted terms by name.
    """
    inc = {r.name: _increments(r, loopback, cores) for r in runs}
    fits = {name: pool_bookkeeping([i]) for name, i in inc.items()}
    checks = []
    for r, (calib, pool) in sources(runs, cores).items():
        base = r.config.topology(loopback, cores)
        pooled = pool_bookkeeping([inc[p.name] for p in pool])
        topo = replace(base, **pooled)
        rows = _predict(topo, r.measured, calib.model(topo))
        scored = r.config.scored(cores)
        if scored:  # the in-sample prediction, as bench sim scored before: labelled
            own = replace(base, **fits[r.name])
            for row, mine in zip(rows, _predict(own, r.measured, r.model(own)), strict=True):
                row["error_in_sample"] = mine["error"]
        where = {
            "where": r.config.label, "job": r.job, "scored": scored,
            "ranks_per_core": r.config.world / cores, "load_1m": r.load_1m,
            "calibration_source": calib.name + (" (own run: in sample)" if calib is r else ""),
            "fit_sources": [p.name + (" (own run: in sample)" if p is r else "") for p in pool],
            "bookkeeping_fit": pooled,
        }  # fmt: skip
        checks += [where | row for row in rows]
    return checks, fits


def _stats(values: list[float]) -> tuple[float | None, float | None]:
    return (statistics.median(values), max(values)) if values else (None, None)


def summarize(checks: list[dict]) -> dict:
    """The summary's errors: out of sample over the scored checks (rounds and exposed
    latencies), the same checks in sample (labelled), and the oversubscribed ones beside."""
    scored = [c for c in checks if c["scored"]]
    over = [c for c in checks if not c["scored"]]
    med, worst = _stats([abs(c["error"]) for c in scored])
    med_in, worst_in = _stats([abs(c["error_in_sample"]) for c in scored])
    med_over, worst_over = _stats([abs(c["error"]) for c in over])
    rounds = [c for c in scored if c["metric"] == "round"]
    return {
        "median_error_out_of_sample": med,
        "worst_error_out_of_sample": worst,
        "median_round_error_out_of_sample": _stats([abs(c["error"]) for c in rounds])[0],
        "median_exposed_error_out_of_sample": _stats(
            [abs(c["error"]) for c in scored if c["metric"] == "exposed"]
        )[0],
        "median_collectives_error_out_of_sample": _stats(
            [abs(c["collectives_error"]) for c in rounds]
        )[0],
        "scored_checks": len(scored),
        "scored_set": list(dict.fromkeys(c["where"] for c in scored)),
        "median_error_in_sample": med_in,
        "worst_error_in_sample": worst_in,
        "oversubscribed_set": list(dict.fromkeys(c["where"] for c in over)),
        "median_error_oversubscribed": med_over,
        "worst_error_oversubscribed": worst_over,
    }
