"""Pacing generation by policy version, so that nothing is dropped for staleness.

Each producer owns a share ``q`` of the global batch (``groups_per_batch`` split over the
producers); at version ``v`` it may have started at most ``(v + max_policy_age + 1) * q``
groups in all. Summed over producers, at most ``(V + 1) * groups_per_batch`` groups carry a
version ``<= V - max_policy_age``, and ``V`` global batches have been consumed before the
learners' version ``V``: what is left of them fits in batch ``V``, which the round's selection
fills with them first (waiting for those still generating). So every group is consumed within
``max_policy_age`` versions of the one it was generated with, provided the learners publish
one version per global batch.
"""

from __future__ import annotations

from conduit_dist.errors import ConfigError


class Pacer:
    """This rank's generation allowance.

    Args:
        max_age: ``max_policy_age`` (``None``: no pacing).
        groups_per_batch: the global batch in groups (``None``: no pacing).
        producers: the producer ranks.
        rank: this rank.

    Raises:
        ConfigError: if ``groups_per_batch`` is set but below the number of producers, or
            given without ``max_policy_age``.
    """

    def __init__(
        self,
        max_age: int | None,
        groups_per_batch: int | None,
        producers: tuple[int, ...],
        rank: int,
    ) -> None:
        n = groups_per_batch
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < len(producers)):
            raise ConfigError(
                f"groups_per_batch: expected an int >= {len(producers)} (one group "
                f"per producer at least), got {n!r}"
            )
        if n is not None and max_age is None:
            raise ConfigError(
                "groups_per_batch: paces producers by max_policy_age; expected "
                "max_policy_age to be set too, got None"
            )
        self.on = n is not None
        self.producer, self.producers = rank in producers, len(producers)
        i = producers.index(rank) if self.producer else 0
        self.quota = (n // len(producers) + (i < n % len(producers))) if self.on else 0
        self.max_age = max_age or 0
        self.per_batch = n or 0
        self.started = 0  # groups this rank reserved

    def window(self, version: int) -> int:
        """Groups this producer may have started in all at ``version``."""
        return (version + self.max_age + 1) * self.quota

    def allows(self, n: int, version: int) -> bool:
        """Whether ``n`` more groups may start now at ``version``.

        Raises:
            ConfigError: on a rank that is not a producer, or ``n`` larger than one window.
        """
        if not self.producer:
            raise ConfigError("reserve: this rank is not in producer_ranks")
        if not self.on:
            return True
        if n > (self.max_age + 1) * self.quota:
            raise ConfigError(
                f"reserve: {n} groups at once exceed this producer's window of "
                f"{(self.max_age + 1) * self.quota} (its share {self.quota} of "
                "groups_per_batch x (max_policy_age + 1)); reserve fewer"
            )
        return self.started + n <= self.window(version)
