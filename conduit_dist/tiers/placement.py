"""Placement: which shard each staged item of a round goes to.

Every rank computes the same plan from the round's staged counts, which all ranks hold after the
meta exchange, so no extra round trip is needed. A plan is a ``[world, world]`` matrix
``send[src, dst]`` of item counts; each source's items to one destination are contiguous in its
staging buffer, in destination order, so the plan maps directly onto ``all_to_all_single`` splits.
"""

from __future__ import annotations

import numpy as np

from conduit_dist.errors import ConfigError

POLICIES = ("round_robin", "local", "bandwidth_aware")


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
    if policy == "bandwidth_aware":
        raise ConfigError("placement: bandwidth_aware needs plan_bandwidth_aware (links, learners)")
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


def plan_bandwidth_aware(
    staged: np.ndarray,
    capacities: np.ndarray,
    learners: np.ndarray,
    links: np.ndarray,
    link_cost: tuple[float, float, float] = (0.0, 1.0, 8.0),
    reads_per_write: float = 1.0,
) -> np.ndarray:
    """Place each source's items where ingesting and then delivering them costs least.

    The cost of putting an item from ``s`` on shard ``d`` is the link cost of ingesting it
    (``s -> d``) plus ``reads_per_write`` (items the learners fetch per item put, i.e. the replay
    ratio of the round) times the cost of delivering from ``d`` to its nearest learner. So at a
    low replay ratio items stay where they were produced, and at a high one they move next to the
    learners that will read them. A shard takes at most its capacity in one round (more would be
    evicted in the same round); cost levels are filled cheapest first over all sources, and a
    source's items are spread evenly over equally cheap shards. The same on every rank.

    Args:
        staged: ``[world]`` items staged on each rank.
        capacities: ``[world]`` items each shard holds.
        learners: ``[world]`` bool, ranks that fetch.
        links: ``[world, world]`` link class index (0 self, 1 host, 2 net).
        link_cost: relative cost per item of each link class.
        reads_per_write: items fetched per item put in the round.

    Returns:
        ``int64 [world, world]`` item counts from each source to each destination.
    """
    world = staged.shape[0]
    per_link = np.asarray(link_cost)[links]  # [src, dst]
    learner_cols = per_link[:, learners] if learners.any() else per_link
    deliver = learner_cols.min(axis=1)  # shard d -> its nearest learner
    cost = per_link + reads_per_write * deliver[None, :]
    room = capacities.astype(np.int64).copy()
    plan = np.zeros((world, world), dtype=np.int64)
    left = staged.astype(np.int64).copy()
    for level in np.unique(np.round(cost, 9)):  # cheapest level first, over all sources
        for src in np.nonzero(left)[0]:
            dsts = [d for d in range(world) if np.isclose(cost[src, d], level) and room[d] > 0]
            while left[src] and dsts:  # spread evenly over the equally cheap shards
                share = -(-int(left[src]) // len(dsts))
                for d in list(dsts):
                    take = min(share, int(left[src]), int(room[d]))
                    plan[src, d] += take
                    room[d] -= take
                    left[src] -= take
                    if room[d] == 0:
                        dsts.remove(d)
    for src in np.nonzero(left)[0]:  # more than the whole store in one round: cheapest takes it
        plan[src, min(range(world), key=lambda d: (cost[src, d], d))] += left[src]
    return plan
