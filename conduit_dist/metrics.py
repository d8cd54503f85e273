"""Metrics: a tiny logger protocol, W&B on rank 0, and aggregation across ranks.

Metric namespace (every logger uses the same names):

- ``rl/episode_return``, ``rl/episode_return_100`` (mean of the last 100 episodes), ``rl/episodes``
- ``rate/env_steps_per_s``, ``rate/learner_steps_per_s``
- ``path/<phase>_ms_{mean,max}`` for phases ``ingest``, ``sample``, ``deliver``, ``wait`` (time the
  learner waited for its batch), plus ``path/bytes_in``, ``path/bytes_out``
- ``store/items``, ``store/occupancy``, ``store/tier<i>_<kind>_bytes``, ``store/demotions``,
  ``store/evictions``
- ``train/loss``, ``train/epsilon``, ``train/policy_version``
- the per-iteration breakdown of ``rl/breakdown.py`` (ms per iteration, mean over ranks):
  ``path/iter_{put,exposed,round_cpu}_ms`` and ``train/iter_{act,env,forward,backward,optimizer,
  publish,ddp,cpu,main_cpu,idle,iteration}_ms``

Step axes: ``env_steps`` (all ranks) for ``rl/*``, ``rate/*``, ``train/*``, ``store/*`` and
``path/*``; ``learner_steps`` is logged too.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from conduit_dist.collectives.exchange import Exchange
from conduit_dist.errors import ConfigError

log = logging.getLogger("conduit_dist")


class Logger(Protocol):
    """What the trainer logs to."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record ``metrics`` at ``step``."""

    def close(self) -> None:
        """Flush and release resources."""


class NullLogger:
    """Discards everything (non-zero ranks, ``logger=none``)."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Do nothing."""

    def close(self) -> None:
        """Do nothing."""


class ConsoleLogger:
    """Prints a progress bar and the key metrics through the ``conduit_dist`` logger.

    Args:
        total_steps: env steps of the whole run (for the bar).
    """

    def __init__(self, total_steps: int) -> None:
        self.total = max(total_steps, 1)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Print one progress line."""
        frac = min(step / self.total, 1.0)
        bar = "#" * int(frac * 20) + "-" * (20 - int(frac * 20))
        keys = [
            ("rl/episode_return_100", "ret100", "{:.1f}"),
            ("rate/env_steps_per_s", "env/s", "{:,.0f}"),
            ("path/wait_ms_mean", "wait_ms", "{:.2f}"),
            ("path/total_ms_mean", "round_ms", "{:.2f}"),
            ("train/loss", "loss", "{:.3f}"),
        ]
        parts = [f"{label}={fmt.format(metrics[k])}" for k, label, fmt in keys if k in metrics]
        log.info("[%s] %3.0f%% steps=%d %s", bar, frac * 100, step, " ".join(parts))

    def close(self) -> None:
        """Nothing to release."""


class WandbLogger(ConsoleLogger):
    """Weights & Biases run on rank 0 (also prints to the console).

    Args:
        total_steps: env steps of the whole run.
        project: W&B project.
        mode: ``offline``, ``online`` or ``disabled``.
        config: the resolved run config (stored with the run).
        run_dir: directory under which ``wandb/`` is written.

    Raises:
        ConfigError: on a bad mode. W&B start-up errors propagate: asked-for W&B fails loudly.
    """

    def __init__(
        self,
        total_steps: int,
        project: str,
        mode: str,
        config: dict[str, Any],
        run_dir: str,
        run_id: str | None = None,
    ) -> None:
        super().__init__(total_steps)
        if mode not in ("offline", "online", "disabled"):
            raise ConfigError(f"logger.mode: expected offline|online|disabled, got {mode!r}")
        import wandb

        os.makedirs(run_dir, exist_ok=True)
        self.run = wandb.init(
            project=project, mode=mode, config=config, dir=run_dir, id=run_id,
            resume="allow" if run_id else None,
        )  # fmt: skip
        self.run.define_metric("env_steps")
        for prefix in ("rl", "rate", "path", "store", "train"):
            self.run.define_metric(f"{prefix}/*", step_metric="env_steps")
        self.dir = getattr(self.run, "dir", None)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Log to W&B (with ``env_steps``) and print the console line."""
        self.run.log({**metrics, "env_steps": step})
        super().log(metrics, step)

    def log_histogram(self, name: str, values: list[float], step: int) -> None:
        """Log a histogram of per-iteration values."""
        import wandb

        self.run.log({name: wandb.Histogram(values), "env_steps": step})

    def close(self) -> None:
        """Finish the run (call from a ``finally``)."""
        self.run.finish()


def make_logger(
    kind: str,
    mode: str,
    project: str,
    total_steps: int,
    config: dict[str, Any],
    run_dir: str,
    run_id: str | None = None,
) -> Logger:
    """The logger for this rank: the configured one on rank 0, a no-op elsewhere; W&B resumes
    run ``run_id`` when it exists (a restarted job).

    Raises:
        ConfigError: on an unknown kind.
    """
    if kind not in ("wandb", "console", "none"):
        raise ConfigError(f"logger.kind: expected wandb|console|none, got {kind!r}")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank != 0 or kind == "none":
        return NullLogger()
    if kind == "console":
        return ConsoleLogger(total_steps)
    return WandbLogger(total_steps, project, mode, config, run_dir, run_id)


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
    _metrics_exchange.timeout = timedelta(seconds=timeout_s)
    return _metrics_exchange
