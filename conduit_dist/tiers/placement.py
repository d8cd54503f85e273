"""Placement: which shard each staged item of a round goes to.

Every rank computes the same plan from the round's staged counts, which all ranks hold after the
meta exchange, so no extra round trip is needed. A plan is a ``[world, world]`` matrix
``send[src, dst]`` of item counts; each source's items to one destination are contiguous in its
staging buffer, in destination order, so the plan maps directly onto ``all_to_all_single`` splits.
"""

from __future__ import annotations

import numpy as np

from conduit_dist.errors import ConfigError

POLICIES = ("round_robin", "local")


def plan_ingest(policy: str, staged: np.ndarray, offset: int) -> np.ndarray:
    """Plan where this round's staged items go.

    Args:
        policy: ``round_robin`` (each rank spreads its items over all shards in contiguous,
            near-equal blocks; the remainders are dealt one by one, globally, starting at shard
            ``offset % world``, so shard sizes never differ by more than one item) or ``local``
            (items stay on the rank that put them).
        staged: ``[world]`` items staged on each rank.
        offset: items dealt as remainders in earlier rounds (rotates where remainders go).

    Returns:
        ``int64 [world, world]`` item counts from each source to each destination.

    Raises:
        ConfigError: for an unknown policy.
    """
    world = staged.shape[0]
    if policy == "local":
        return np.diag(staged).astype(np.int64)
    if policy != "round_robin":
        raise ConfigError(f"placement: expected one of {POLICIES}, got {policy!r}")
    plan = np.repeat((staged // world)[:, None], world, axis=1).astype(np.int64)
    rem = staged % world
    starts = offset + np.concatenate([[0], np.cumsum(rem)[:-1]])
    for src in np.nonzero(rem)[0]:
        plan[src, (starts[src] + np.arange(rem[src])) % world] += 1
    return plan


def remainder_dealt(staged: np.ndarray) -> int:
    """How many items a round-robin round dealt as remainders (advances ``offset``)."""
    return int((staged % staged.shape[0]).sum())
