"""Rate limiting over the global store, with Reverb's ``SampleToInsertRatio`` semantics.

With ``samples_per_insert = s``, ``min_size = m`` and ``error_buffer = e`` the limiter keeps
``diff = s * inserts - samples`` (over every shard and learner) inside
``[s * m - e, s * m + e]``: a learner may sample ``k`` items only while ``size >= m`` and
``s * inserts - (samples + k) >= s * m - e``; an actor may insert ``n`` only while
``s * (inserts + n) - samples <= s * m + e``. Without ``samples_per_insert`` only ``min_size``
holds.

Both counts are replicated: every rank adds the round's ingested items and allocation after the
meta exchange, so every rank admits the same requests with no extra round trip (every fetching
learner's request or none: learners that average gradients leave their fetches together). A side
that may not proceed waits *inside the round protocol*: a refused fetch runs further rounds (the
actors' flushes keep ingesting), a refused ``put`` runs ``flush`` rounds (the learners keep
sampling), each until the limit lets it pass or ``timeout_s`` elapses, when
:class:`~conduit_dist.errors.RateLimitError` names the limit that held it and the counts. Time
blocked per side is counted (``store_stats()``). A put (times ``samples_per_insert``) or fetch
wider than the band (``2 * error_buffer``) could never pass and is refused (``ConfigError``); a
put and a fetch that together exceed it can hold each other until the timeout.

The insert side sees the global inserts as of the latest round plus its own staged items: other
actors' puts of the same round can overshoot ``max_diff`` by at most one round's puts.
"""

from __future__ import annotations

import math

import numpy as np

from conduit_dist.errors import ConfigError


class RateLimiter:
    """Samples-per-insert with an error buffer, and a minimum size before the first sample.

    Args:
        samples_per_insert: target ratio of sampled to inserted items (``None``: no ratio).
        min_size: items the global store must hold before any learner samples.
        error_buffer: how far ``diff`` may stray from ``samples_per_insert * min_size`` (needed
            with a ratio; at least ``max(1, samples_per_insert)`` so single steps fit).
        timeout_s: how long a side waits before ``RateLimitError``.

    Raises:
        ConfigError: naming the argument, the expected and the received value.
    """

    def __init__(
        self,
        samples_per_insert: float | None = None,
        min_size: int = 1,
        error_buffer: float | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 1:
            raise ConfigError(f"RateLimiter min_size: expected an int >= 1, got {min_size!r}")
        if not (isinstance(timeout_s, int | float) and timeout_s > 0 and math.isfinite(timeout_s)):
            raise ConfigError(f"RateLimiter timeout_s: expected a number > 0, got {timeout_s!r}")
        if samples_per_insert is not None:
            spi = samples_per_insert
            if not (isinstance(spi, int | float) and spi > 0 and math.isfinite(spi)):
                raise ConfigError(
                    f"RateLimiter samples_per_insert: expected a number > 0 or None, got {spi!r}"
                )
            ok = isinstance(error_buffer, int | float) and not isinstance(error_buffer, bool)
            if not ok or not error_buffer >= max(1.0, spi):
                raise ConfigError(
                    f"RateLimiter error_buffer: expected a number >= max(1, samples_per_insert) "
                    f"= {max(1.0, spi):g} with a ratio, got {error_buffer!r}"
                )
        elif error_buffer is not None:
            raise ConfigError(
                f"RateLimiter error_buffer: only with samples_per_insert, got {error_buffer!r} "
                "without a ratio"
            )
        self.samples_per_insert, self.min_size = samples_per_insert, min_size
        self.error_buffer, self.timeout_s = error_buffer, float(timeout_s)
        centre = (samples_per_insert or 0.0) * min_size
        self.min_diff = centre - (error_buffer or 0.0)
        self.max_diff = centre + (error_buffer or 0.0)
        self.inserted = 0  # items ingested over all shards (replicated)
        self.sampled = 0  # items delivered over all learners (replicated)
        self.blocked_s = {"sample": 0.0, "insert": 0.0}

    @property
    def diff(self) -> float:
        """``samples_per_insert * inserts - samples`` now."""
        return (self.samples_per_insert or 0.0) * self.inserted - self.sampled

    def allowed(self, stored: int) -> int:
        """Items the learners may sample now, over all of them (the same on every rank after
        a round): a colocated loop runs ``allowed(plane.stored) // global_batch`` updates."""
        if stored < self.min_size:
            return 0
        if self.samples_per_insert is None:
            return stored
        return max(0, math.floor(self.diff - self.min_diff))

    def admit(self, requests: np.ndarray, stored: int) -> np.ndarray:
        """The requests the limits let through this round: every fetching learner's or none
        (learners that average gradients must leave their fetches in the same round); the same
        on every rank."""
        if stored < self.min_size:
            return np.zeros_like(requests)
        room = math.inf if self.samples_per_insert is None else self.diff - self.min_diff
        return requests if int(requests.sum()) <= room else np.zeros_like(requests)

    def check_size(self, side: str, n: int) -> None:
        """Refuse a fetch or put that no state of the band could ever let through.

        Raises:
            ConfigError: when ``n`` (times ``samples_per_insert`` for a put) exceeds the band's
                width ``2 * error_buffer``.
        """
        if self.samples_per_insert is None:
            return
        need = n * (self.samples_per_insert if side == "insert" else 1.0)
        if need > 2 * self.error_buffer:
            what = f"samples_per_insert x {n}" if side == "insert" else f"{n}"
            raise ConfigError(
                f"{'put' if side == 'insert' else 'fetch'}: {what} = {need:g} is wider than the "
                f"rate limiter's band (2 x error_buffer = {2 * self.error_buffer:g}), so it could "
                f"never pass; use a larger error_buffer or a smaller "
                f"{'put' if side == 'insert' else 'batch'}"
            )

    def can_insert(self, n: int) -> bool:
        """Whether ``n`` more inserts keep ``diff`` at most ``max_diff``."""
        if self.samples_per_insert is None:
            return True
        return self.samples_per_insert * (self.inserted + n) - self.sampled <= self.max_diff

    def holds(self, side: str, n: int, stored: int) -> str:
        """What holds a side back, in words (for ``RateLimitError``)."""
        spi = self.samples_per_insert
        counts = f"{self.inserted} inserted, {self.sampled} sampled, {stored} stored"
        if side == "sample" and stored < self.min_size:
            return f"min_size={self.min_size} ({counts})"
        bound = self.min_diff if side == "sample" else self.max_diff
        return (
            f"samples_per_insert={spi:g} with error_buffer={self.error_buffer:g}: {side} of {n} "
            f"would take samples_per_insert * inserts - samples (now {self.diff:g}) "
            f"{'below' if side == 'sample' else 'above'} {bound:g} ({counts})"
        )

    def state_dict(self) -> dict[str, object]:
        """The replicated counts and the time blocked."""
        return {"inserted": self.inserted, "sampled": self.sampled, **self.blocked_s}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict`."""
        self.inserted, self.sampled = int(state["inserted"]), int(state["sampled"])
        self.blocked_s = {"sample": float(state["sample"]), "insert": float(state["insert"])}
