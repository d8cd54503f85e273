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
        policy: ``round_robin`` (the round's items are spread so shards fill evenly, the remainder
            rotating with ``offset``) or ``local`` (items stay on the rank that put them).
        staged: ``[world]`` items staged on each rank.
        offset: rotation of the remainder (e.g. items ingested so far).

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
    total = int(staged.sum())
    share = np.full(world, total // world, dtype=np.int64)
    extra = (offset + np.arange(total % world)) % world
    share[extra] += 1
    # Lay the round's items on one line in source order; destination d takes a contiguous segment.
    src_edges = np.concatenate([[0], np.cumsum(staged)])
    dst_edges = np.concatenate([[0], np.cumsum(share)])
    lo = np.maximum(src_edges[:-1, None], dst_edges[None, :-1])
    hi = np.minimum(src_edges[1:, None], dst_edges[None, 1:])
    return np.maximum(hi - lo, 0).astype(np.int64)
