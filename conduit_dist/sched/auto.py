"""``schedule="auto"``: time both schedules on this rank and keep the faster.

A learner runs ``n`` iterations (fetch to fetch) in ``sync``, then ``n`` in ``overlap``, and keeps
the mode with the lower median (the first fifth of each is warm-up). Ranks may settle on different
modes: every fetch and flush owns exactly one round whenever it runs, so lockstep holds.
"""

from __future__ import annotations

import statistics

from conduit_dist.errors import ConfigError


class AutoTrial:
    """Iteration times per schedule and the choice.

    Args:
        n: iterations timed per mode (>= 5).

    Raises:
        ConfigError: if ``n < 5``.
    """

    def __init__(self, n: int) -> None:
        if n < 5:
            raise ConfigError(f"auto_trial: expected >= 5 iterations per mode, got {n}")
        self.n = n
        self.times: dict[str, list[float]] = {"sync": [], "overlap": []}
        self.last: float | None = None
        self.choice: str | None = None

    def median(self, mode: str) -> float:
        """Median iteration milliseconds of ``mode`` after warm-up (inf before any)."""
        kept = self.times[mode][self.n // 5 :]
        return statistics.median(kept) if kept else float("inf")

    def tick(self, t: float, mode: str) -> str | None:
        """Record the iteration ending at ``t`` run in ``mode``; returns a mode to switch to."""
        if self.choice is not None:
            return None
        if self.last is not None:
            self.times[mode].append((t - self.last) * 1e3)
        self.last = t
        if len(self.times[mode]) < self.n:
            return None
        if mode == "sync":
            self.last = None
            return "overlap"  # from the next backward on
        self.choice = "overlap" if self.median("overlap") < self.median("sync") else "sync"
        return self.choice

    def describe(self) -> str:
        """One line for the log."""
        return (
            f"schedule=auto chose {self.choice} (median iteration sync "
            f"{self.median('sync'):.2f} ms, overlap {self.median('overlap'):.2f} ms)"
        )
