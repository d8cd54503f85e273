"""Exceptions raised by conduit_dist."""

from __future__ import annotations


class SpecError(ValueError):
    """A batch or spec does not match what was expected (names the field, expected, received)."""


class ConfigError(ValueError):
    """A configuration value is invalid (names the field, expected, received)."""


class RoundError(RuntimeError):
    """A round of the data plane failed or timed out on some rank.

    Attributes:
        round: the round number that failed.
        ranks: the ranks known to have not reached the round (empty when unknown).
    """

    def __init__(self, message: str, round: int, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.round = round
        self.ranks = ranks


class PhaseError(RoundError):
    """A collective outside the rounds failed or timed out on some rank.

    Raised by the start-up phases (host discovery, calibration, agreeing on the bandwidth model)
    and by ``metrics.aggregate``; a subclass of :class:`RoundError`, so code that catches round
    failures catches these too. ``round`` is ``-1``.

    Attributes:
        phase: the phase's name, e.g. ``"start-up: discover hosts"`` or ``"metrics.aggregate"``.
        ranks: the ranks known to have not entered the phase (empty when unknown).
    """

    def __init__(self, message: str, phase: str, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message, round=-1, ranks=ranks)
        self.phase = phase


class EmptyStoreError(RuntimeError):
    """``fetch`` found no stored item over all shards (the round itself completed)."""


class StaleDataError(RuntimeError):
    """``fetch`` would have returned items older than ``max_policy_age`` allows (the round
    itself completed; the batch was not returned)."""


class RateLimitError(RuntimeError):
    """A ``fetch`` or ``put`` waited longer than its rate limiter's ``timeout_s``; the message
    names the limit that held it and the global counts."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or restored: torn or corrupted files (named), ranks
    that disagree, a background write that failed (raised at the next call), or no checkpoint
    where one was asked for."""
