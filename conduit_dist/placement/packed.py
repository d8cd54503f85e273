"""Packed plans: a round's items onto a chosen set of shards, equal shares, fewest messages.

``bandwidth_aware`` prices these beside its other candidates. With a per-message cost in the
bandwidth model, storing on fewer shards (a few per host, or only the learners) can pay: the
learners then read from fewer shards, and each source sends to one or two destinations instead
of many.
"""

from __future__ import annotations

import numpy as np


def host_ids(links: np.ndarray) -> np.ndarray:
    """``[world]`` the first rank of each rank's host (its host's id), from the link classes.

    Args:
        links: ``[world, world]`` link class index (0 self, 1 host, 2 net).
    """
    return np.argmax(links <= 1, axis=1)


def running(values: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """``[n]`` the sum of ``values`` over each entry and the entries before it in its group.

    Args:
        values: ``[n]`` numbers, in rank order.
        groups: ``[n]`` group id of each entry (groups need not be contiguous).
    """
    upto = (groups[:, None] == groups[None, :]) & np.tri(values.shape[0], dtype=bool)
    return upto @ values.astype(np.int64)


def first_per_host(eligible: np.ndarray, hosts: np.ndarray, k: int) -> np.ndarray:
    """``[world]`` bool: the first ``k`` eligible ranks of every host, in rank order.

    Args:
        eligible: ``[world]`` bool, ranks that may be chosen.
        hosts: ``[world]`` host id of each rank (:func:`host_ids`).
        k: ranks to choose per host (all of a host's eligible ranks where it has fewer).
    """
    return eligible & (running(eligible, hosts) <= k)


def _fill(plan: np.ndarray, left: np.ndarray, room: np.ndarray, groups: np.ndarray) -> None:
    """Move ``left`` into ``room`` within each group, one after another in rank order.

    In each group, sources and destinations are laid end to end as intervals from the group's
    start (the north-west corner rule); a pair's flow is the overlap of their intervals, so a
    source spills into the next destination only when one is full.
    """
    srcs, dsts = np.nonzero(left)[0], np.nonzero(room)[0]
    if srcs.size == 0 or dsts.size == 0:
        return
    a_end, b_end = running(left[srcs], groups[srcs]), running(room[dsts], groups[dsts])
    a, b = a_end - left[srcs], b_end - room[dsts]  # where each interval starts
    flow = np.minimum(a_end[:, None], b_end[None, :]) - np.maximum(a[:, None], b[None, :])
    same = groups[srcs][:, None] == groups[dsts][None, :]
    flow = np.where(same, np.maximum(flow, 0), 0)
    plan[np.ix_(srcs, dsts)] += flow
    left[srcs] -= flow.sum(axis=1)
    room[dsts] -= flow.sum(axis=0)


def plan_packed(staged: np.ndarray, stores: np.ndarray, links: np.ndarray) -> np.ndarray:
    """Route every staged item onto the shards in ``stores``, each taking an equal share.

    Every storing shard takes ``total // n`` items of the round (``n`` storing shards; the
    remainder one each to the first, in rank order), as one global FIFO would, so they all hold
    equally fresh data. A storing source keeps its own items first, then items move within each
    host, then between hosts; at each step sources fill destinations one after another in rank
    order, so a source sends to as few destinations as its items need (one or two) and a
    destination hears from as few sources: the fewest messages for the same bytes.

    Args:
        staged: ``[world]`` items staged on each rank.
        stores: ``[world]`` bool, the shards that take items (at least one).
        links: ``[world, world]`` link class index (0 self, 1 host, 2 net).

    Returns:
        ``int64 [world, world]`` item counts from each source to each destination.

    Raises:
        ValueError: if ``stores`` selects no shard.
    """
    world = staged.shape[0]
    shards = np.nonzero(stores)[0]
    if shards.size == 0:
        raise ValueError(f"stores: expected at least one storing shard of {world}, got none")
    total = int(staged.sum())
    room = np.zeros(world, dtype=np.int64)
    room[shards] = total // shards.size
    room[shards[: total % shards.size]] += 1
    left = staged.astype(np.int64).copy()
    plan = np.zeros((world, world), dtype=np.int64)
    keep = np.minimum(left, room)  # a storing source keeps its own items first
    plan[np.diag_indices(world)] += keep
    left -= keep
    room -= keep
    _fill(plan, left, room, host_ids(links))  # then within each host
    _fill(plan, left, room, np.zeros(world, dtype=np.int64))  # then between hosts
    return plan
