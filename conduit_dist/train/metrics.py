"""Metrics: a tiny logger protocol, the run's local metrics file, W&B, and aggregation.

Rank 0 logs to a :class:`RunLogger` (built by :func:`make_logger`), which hands every log step
to its sinks: always a ``MetricsFile`` (``conduit_dist/tools/report.py``: ``RUN_DIR/metrics.jsonl``,
one JSON object per log step, and ``RUN_DIR/run.json``, read by ``python -m conduit_dist.report``),
the console display ``logger.progress`` picks (``conduit_dist/train/progress.py``; not with
``logger=none``) and, with ``logger=wandb``, a :class:`WandbLogger`. Other ranks get a
:class:`NullLogger`.

Metric namespace (every sink uses the same names):

- ``rl/episode_return``, ``rl/episode_return_100`` (mean of the last 100 episodes), ``rl/episodes``
- ``rate/env_steps_per_s``, ``rate/learner_steps_per_s``
- ``path/<phase>_ms_{mean,max}`` for phases ``ingest``, ``sample``, ``deliver``, ``wait`` (time the
  learner waited for its batch), ``exposed`` / ``hidden`` (the round's time the learner waited
  for / that ran behind its compute), plus ``path/bytes_in``, ``path/bytes_out`` and
  ``path/bytes_{self,host,net}`` (bytes the rounds sent, by link class, over all ranks, in the
  log interval; ``RoundStats.sent``)
- ``store/items``, ``store/occupancy``, ``store/tier<i>_<kind>_bytes``, ``store/demotions``,
  ``store/evictions``, ``store/host_syncs``
- ``train/loss``, ``train/epsilon``, ``train/policy_version``
- the per-iteration breakdown of ``rl/breakdown.py`` (ms per iteration, mean over ranks):
  ``path/iter_{put,exposed,round_cpu}_ms`` and ``train/iter_{act,env,forward,backward,optimizer,
  publish,ddp,cpu,main_cpu,idle,iteration}_ms``
- histograms (W&B ``wandb.Histogram``; in ``metrics.jsonl`` as ``<name>_{p50,p90,p99,max}``):
  ``path/exposed_ms_hist``, ``path/hidden_ms_hist``, ``path/policy_age_hist`` (newest policy
  version minus each fetched item's ``_version``; its maximum over ranks: ``path/policy_age_max``)

Step axes: ``env_steps`` (all ranks) for ``rl/*``, ``rate/*``, ``train/*``, ``store/*`` and
``path/*``; ``learner_steps`` is logged too.
"""

from __future__ import annotations

import logging
import math
import os
import time
from datetime import timedelta
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from conduit_dist.collectives.dist import on_destroy
from conduit_dist.collectives.exchange import Exchange
from conduit_dist.collectives.topology import LINKS
from conduit_dist.errors import ConfigError
from conduit_dist.extras import require
from conduit_dist.tools.report import MetricsFile
from conduit_dist.train.progress import ConsoleLogger

log = logging.getLogger("conduit_dist")

Histograms = dict[str, list[float]]


class Logger(Protocol):
    """What the trainer logs to."""

    def log(self, metrics: dict[str, float], step: int, histograms: Histograms | None = None):
        """Record ``metrics`` (and per-iteration ``histograms``) at env step ``step``."""

    def close(self) -> None:
        """Flush and release resources."""


class NullLogger:
    """Discards everything (non-zero ranks)."""

    def log(self, metrics: dict[str, float], step: int, histograms: Histograms | None = None):
        """Do nothing."""

    def close(self) -> None:
        """Do nothing."""


class WandbLogger:
    """Weights & Biases run on rank 0.

    ``env_steps`` is the x-axis of every namespace (``define_metric``); the run's summary holds
    ``rl/best_return_100`` and, once the last-100 return reaches ``target_return``,
    ``rl/time_to_target_s`` (since this logger started) and ``rl/env_steps_to_target``.
    Histograms are logged as ``wandb.Histogram`` in the same step.

    Args:
        project: W&B project.
        mode: ``offline``, ``online`` or ``disabled``.
        config: the resolved run config (stored with the run).
        run_dir: directory under which ``wandb/`` is written.
        run_id: resume this run (a restarted job).
        target_return: the run's target (``None``: none).
        world_size: ranks in the job (added to the run's config).

    Raises:
        ConfigError: on a bad mode. W&B start-up errors propagate: asked-for W&B fails loudly.
        ModuleNotFoundError: without wandb (the ``[train]`` extra), saying so.
    """

    def __init__(
        self,
        project: str,
        mode: str,
        config: dict[str, Any],
        run_dir: str,
        run_id: str | None = None,
        target_return: float | None = None,
        world_size: int = 1,
    ) -> None:
        if mode not in ("offline", "online", "disabled"):
            raise ConfigError(f"logger.mode: expected offline|online|disabled, got {mode!r}")
        with require("train", "the W&B logger (logger=wandb)"):
            import wandb

        os.makedirs(run_dir, exist_ok=True)
        self.run = wandb.init(
            project=project, mode=mode, config={**config, "world_size": world_size},
            dir=run_dir, id=run_id, resume="allow" if run_id else None,
        )  # fmt: skip
        self.run.define_metric("env_steps")
        self.run.define_metric("learner_steps", step_metric="env_steps")
        for prefix in ("rl", "rate", "path", "store", "train"):
            self.run.define_metric(f"{prefix}/*", step_metric="env_steps")
        self.dir = getattr(self.run, "dir", None)
        self.target, self.t0, self.best = target_return, time.perf_counter(), -math.inf
        self.reached = False

    def log(self, metrics: dict[str, float], step: int, histograms: Histograms | None = None):
        """Log to W&B (with ``env_steps``) and update the summary."""
        import wandb

        row: dict[str, Any] = {**metrics, "env_steps": step}
        for name, values in (histograms or {}).items():
            if len(values):
                row[name] = wandb.Histogram(np.asarray(values, dtype=np.float64))
        self.run.log(row)
        ret = metrics.get("rl/episode_return_100", math.nan)  # absent before a first episode
        if math.isfinite(ret) and ret > self.best:
            self.best = ret
            self.run.summary["rl/best_return_100"] = ret
        if self.target is not None and not self.reached and ret >= self.target:
            self.reached = True
            self.run.summary["rl/time_to_target_s"] = time.perf_counter() - self.t0
            self.run.summary["rl/env_steps_to_target"] = step

    def close(self) -> None:
        """Finish the run (call from a ``finally``)."""
        self.run.finish()


class RunLogger:
    """Rank 0's logger: hands every log step to each sink in turn; closes them all.

    Args:
        sinks: loggers, e.g. ``[MetricsFile(...), ConsoleLogger(...), WandbLogger(...)]``.
    """

    def __init__(self, sinks: list[Logger]) -> None:
        self.sinks = sinks

    def log(self, metrics: dict[str, float], step: int, histograms: Histograms | None = None):
        """Log to every sink."""
        for sink in self.sinks:
            sink.log(metrics, step, histograms)

    def close(self) -> None:
        """Close every sink (all of them, even if one fails; then the first error is raised)."""
        first = None
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:
                first = first or e
        if first is not None:
            raise first


def make_logger(
    kind: str,
    mode: str,
    project: str,
    total_steps: int,
    config: dict[str, Any],
    run_dir: str,
    run_id: str | None = None,
) -> Logger:
    """The logger for this rank: on rank 0 the run's metrics file in ``run_dir``, the console
    display (kinds ``console`` and ``wandb``) and W&B (kind ``wandb``, resuming run ``run_id``
    when it exists); a no-op elsewhere.

    Args:
        kind: ``wandb``, ``console`` or ``none``.
        mode: W&B mode.
        project: W&B project.
        total_steps: env steps of the whole run.
        config: the resolved run config (``TrainConfig`` as a dict).
        run_dir: the run's directory (``metrics.jsonl``, ``run.json``, ``wandb/``).
        run_id: W&B run id to resume.

    Returns:
        A :class:`RunLogger` on rank 0, a :class:`NullLogger` elsewhere.

    Raises:
        ConfigError: on an unknown kind or progress mode.

    Example::

        logger = make_logger("none", "disabled", "p", 4000, cfg_dict, "outputs/run-1")
        logger.log({"rl/episode_return_100": 21.0}, 800)
        logger.close()
    """
    if kind not in ("wandb", "console", "none"):
        raise ConfigError(f"logger.kind: expected wandb|console|none, got {kind!r}")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank != 0:
        return NullLogger()
    world = dist.get_world_size() if dist.is_initialized() else 1
    sinks: list[Logger] = [MetricsFile(run_dir, config, world)]
    if kind != "none":  # the display logger.progress picks
        sinks.append(ConsoleLogger(total_steps, config["logger"]["progress"]))
    if kind == "wandb":
        target = config["target_return"]
        sinks.append(WandbLogger(project, mode, config, run_dir, run_id, target, world))
    return RunLogger(sinks)


def store_values(store: dict[str, Any] | None) -> dict[str, float]:
    """This rank's store values to :func:`aggregate` (the same keys on every rank).

    Args:
        store: ``DataPlane.store_stats()`` (``None``: a plane without tiers; no values).

    Returns:
        ``tier<i>_<kind>_bytes``, ``demotions``, ``evictions``, ``demotion_wait_ms`` and
        ``host_syncs`` (the library's deliberate host syncs so far, ``conduit_dist.syncs``).
    """
    if store is None:
        return {}
    out = {f"tier{i}_{t['kind']}_bytes": float(t["bytes"]) for i, t in enumerate(store["tiers"])}
    out["demotions"], out["evictions"] = store["demotions"], store["evictions"]
    out["demotion_wait_ms"] = store.get("demotion_wait_ms", 0.0)
    out["host_syncs"] = float(sum(store.get("host_syncs", {}).values()))
    return out


def store_metrics(agg: dict[str, float], store: dict[str, Any] | None, world: int):
    """The ``store/*`` metrics from :func:`aggregate` of :func:`store_values`: bytes per tier
    (mean over ranks), demotions and evictions (sums), the slowest rank's demotion wait.

    Args:
        agg: the aggregated values.
        store: this rank's ``store_stats()`` (``None``: no metrics).
        world: ranks in the job.

    Returns:
        ``{"store/tier0_host_bytes": ..., "store/demotions": ..., ...}``.
    """
    if store is None:
        return {}
    out = {}
    for i, tier in enumerate(store["tiers"]):
        key = f"tier{i}_{tier['kind']}_bytes"
        out[f"store/{key}"] = agg[f"{key}_mean"]
    out["store/demotions"] = agg["demotions_mean"] * world
    out["store/evictions"] = agg["evictions_mean"] * world
    out["store/demotion_wait_ms"] = agg["demotion_wait_ms_max"]
    out["store/host_syncs"] = agg["host_syncs_mean"] * world  # the library's, all ranks so far
    return out


def link_bytes(sent: np.ndarray | None, links: np.ndarray) -> dict[str, float]:
    """Bytes a rank sent, summed by link class (values to :func:`aggregate`).

    Args:
        sent: bytes sent to each rank (``[world]``; ``RoundStats.sent`` summed over rounds;
            ``None``: nothing sent).
        links: this rank's row of ``Topology.link_matrix()`` (``[world]`` indices into
            ``LINKS``).

    Returns:
        ``{"bytes_self": ..., "bytes_host": ..., "bytes_net": ...}``.

    Example::

        link_bytes(np.array([100, 40]), np.array([0, 1]))  # self 100, host 40, net 0
    """
    sent = np.zeros(len(links)) if sent is None else sent
    per = np.bincount(links, weights=sent, minlength=len(LINKS))
    return {f"bytes_{name}": float(per[i]) for i, name in enumerate(LINKS)}


def link_metrics(agg: dict[str, float], world: int) -> dict[str, float]:
    """``path/bytes_{self,host,net}``: the bytes all ranks sent, from :func:`aggregate` of
    :func:`link_bytes`."""
    return {f"path/bytes_{c}": agg[f"bytes_{c}_mean"] * world for c in LINKS}


def aggregate(values: dict[str, float], timeout_s: float = 60.0) -> dict[str, float]:
    """Mean and max of each value over all ranks (a collective: every rank must call it).

    Runs on the default group as the phase ``metrics.aggregate``: each all-reduce waits at most
    ``timeout_s``.

    Args:
        values: the same keys, in the same order, on every rank.
        timeout_s: seconds each collective may take.

    Returns:
        ``{key + "_mean": ..., key + "_max": ...}``.

    Raises:
        ConfigError: if ``timeout_s`` is not positive.
        PhaseError: if a rank does not join within ``timeout_s`` (naming this rank, the timeout
            and, where the rendezvous store can tell, the ranks that never called it).

    Example::

        agg = aggregate({"loss": 0.5, "items": 100.0})
        agg["loss_mean"], agg["items_max"]
    """
    if not timeout_s > 0:
        raise ConfigError(f"metrics.aggregate timeout_s: expected > 0 seconds, got {timeout_s}")
    keys = list(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        ex = _exchange(timeout_s)
        sums, maxes = t.clone(), t.clone()
        with ex.phase("metrics.aggregate"):
            ex.run(
                lambda: dist.all_reduce(sums, dist.ReduceOp.SUM, group=ex.group, async_op=True),
                "all_reduce(sum)",
            )
            ex.run(
                lambda: dist.all_reduce(maxes, dist.ReduceOp.MAX, group=ex.group, async_op=True),
                "all_reduce(max)",
            )
        mean, mx = sums / world, maxes
    else:
        mean, mx = t, t
    out = {}
    for i, k in enumerate(keys):
        out[f"{k}_mean"] = float(mean[i])
        out[f"{k}_max"] = float(mx[i])
    return out


_metrics_exchange: Exchange | None = None


def _drop_exchange() -> None:
    """Let go of the metrics' Exchange (and the default group it holds): ``destroy_distributed``
    calls it first (``collectives.dist.on_destroy``)."""
    global _metrics_exchange
    _metrics_exchange = None


def _exchange(timeout_s: float) -> Exchange:
    """The default group's Exchange for metrics, kept across calls so its phases count on.

    Every rank numbers its ``metrics.aggregate`` calls the same way; a fresh Exchange per call would
    restart the count and read the previous call's marks as arrivals. A new default group (after
    ``destroy_process_group``) gets a new Exchange.
    """
    global _metrics_exchange
    world = dist.group.WORLD
    if _metrics_exchange is None or _metrics_exchange.group is not world:
        _metrics_exchange = Exchange(timeout_s, group=world, name="metrics")
        on_destroy(_drop_exchange)
    _metrics_exchange.timeout = timedelta(seconds=timeout_s)
    return _metrics_exchange
