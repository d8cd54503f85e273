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


class EmptyStoreError(RuntimeError):
    """``fetch`` found no stored item over all shards (the round itself completed)."""
