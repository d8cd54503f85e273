"""The DQN trainer's log window: what it measures between two logs, and the numbers it reports.

:class:`Window` collects each round's timings and bytes, the fetched items' policy ages, the
per-iteration breakdown and the losses of the iterations between two logs;
:meth:`Window.values` gives this rank's numbers of it to
:func:`~conduit_dist.train.metrics.aggregate`, :func:`phase_metrics` names the aggregated
timings, and :meth:`Window.histograms` gives rank 0's per-iteration histograms.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from conduit_dist.plane import RoundStats
from conduit_dist.train.breakdown import PARTS, Breakdown
from conduit_dist.train.metrics import link_bytes

PHASES = (
    "ingest",
    "sample",
    "deliver",
    "wait",
    "total",
    "exposed",
    "hidden",
    "iteration",
    "predicted_move",
    "measured_move",
)
"""The per-round and per-iteration times a window keeps (ms), logged as ``path/{p}_ms_*``."""

PATH_PARTS = ("put", "exposed", "round_cpu")  # breakdown parts logged under path/, others train/


@dataclass
class Window:
    """Per-iteration measurements between two logs."""

    start: float = field(default_factory=time.perf_counter)
    ms: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PHASES})
    bytes_in: int = 0
    bytes_out: int = 0
    learner_steps: int = 0
    iterations: int = 0
    learning_iterations: int = 0
    breakdown: Breakdown = field(default_factory=Breakdown)
    losses: list[torch.Tensor] = field(default_factory=list)  # 0-d, on the learner's device
    sent: np.ndarray | None = None  # bytes the rounds sent each rank (RoundStats.sent)
    ages: list[torch.Tensor] = field(default_factory=list)  # fetched items' policy ages
    env_steps0: int = 0  # env steps when the window began (attached actors' rate)

    def add(self, stats: RoundStats, wait_ms: float, hidden_ms: float = 0.0) -> None:
        """Record one round's stats, the time the learner waited for it and the time hidden."""
        for p in ("ingest", "sample", "deliver"):
            self.ms[p].append(getattr(stats, f"{p}_ms"))
        self.ms["total"].append(stats.total_ms)
        self.ms["wait"].append(wait_ms)
        self.ms["exposed"].append(wait_ms)
        self.ms["hidden"].append(hidden_ms)
        for move in getattr(stats, "moves", ()):  # the bandwidth model's prediction vs reality
            self.ms["predicted_move"].append(move.predicted_ms)
            self.ms["measured_move"].append(move.measured_ms)
        self.bytes_in += stats.bytes_in
        self.bytes_out += stats.bytes_out
        if stats.sent is not None:
            self.sent = stats.sent.copy() if self.sent is None else self.sent + stats.sent

    def policy_ages(self) -> list[float]:
        """The fetched items' policy ages (the newest version minus the item's), in order."""
        return torch.cat(self.ages).tolist() if self.ages else []

    def values(self, elapsed: float, ages: list[float], links: np.ndarray) -> dict[str, float]:
        """This rank's numbers of the window, to :func:`~conduit_dist.train.metrics.aggregate`
        (the same keys on every rank).

        Args:
            elapsed: the window's seconds.
            ages: :meth:`policy_ages`.
            links: this rank's row of ``Topology.link_matrix()``.

        Returns:
            Learner steps per second, the mean loss, bytes in and out, the oldest item's age,
            bytes sent by link class, the mean of each of :data:`PHASES` (``{p}_ms``) and of each
            breakdown part (``bd_{p}``).
        """
        local = {
            "learner_steps_per_s": self.learner_steps / elapsed,
            "loss": float(torch.stack(self.losses).double().mean()) if self.losses else 0.0,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "age_max": max(ages, default=0),
            **link_bytes(self.sent, links),
        }
        for p, vals in self.ms.items():
            local[f"{p}_ms"] = sum(vals) / len(vals) if vals else 0.0
        for p, v in self.breakdown.means().items():
            local[f"bd_{p}"] = v
        return local

    def histograms(self, ages: list[float]) -> dict[str, list[float]]:
        """The per-iteration histograms rank 0 logs: its exposed and hidden ms, policy ages."""
        hists = {"path/exposed_ms_hist": self.ms["exposed"], "path/policy_age_hist": ages}
        hists["path/hidden_ms_hist"] = self.ms["hidden"]  # rank 0's own iterations
        return hists


def phase_metrics(agg: dict[str, float]) -> dict[str, float]:
    """The timing metrics of an aggregated window: ``path/{p}_ms_mean`` and ``_max`` of each of
    :data:`PHASES`, and the per-iteration breakdown, mean over ranks (``path/iter_{p}_ms`` for
    :data:`PATH_PARTS`, ``train/iter_{p}_ms`` for the other parts).

    Args:
        agg: :func:`~conduit_dist.train.metrics.aggregate` of :meth:`Window.values`.
    """
    metrics = {}
    for p in PHASES:
        metrics[f"path/{p}_ms_mean"] = agg[f"{p}_ms_mean"]
        metrics[f"path/{p}_ms_max"] = agg[f"{p}_ms_max"]
    for p in PARTS:  # the per-iteration breakdown (rl/breakdown.py), mean over ranks
        prefix = "path" if p in PATH_PARTS else "train"
        metrics[f"{prefix}/iter_{p}_ms"] = agg[f"bd_{p}_mean"]
    return metrics
