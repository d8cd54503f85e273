"""Placement: which shard each staged item of a round goes to.

Every rank computes the same plan from the round's staged counts, which all ranks hold after the
meta exchange, so no extra round trip is needed. A plan is a ``[world, world]`` matrix
``send[src, dst]`` of item counts; each source's items to one destination are contiguous in its
staging buffer, in destination order, so the plan maps directly onto ``all_to_all_single`` splits.
"""

from __future__ import annotations

import numpy as np
import torch

from conduit_dist.errors import ConfigError
from conduit_dist.sampling.stratified import allocate_stratified

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


def plan_near_learners(
    staged: np.ndarray,
    capacities: np.ndarray,
    learners: np.ndarray,
    links: np.ndarray,
    link_cost: tuple[float, float, float] = (0.0, 1.0, 8.0),
    reads_per_write: float = 1.0,
) -> np.ndarray:
    """Place each source's items where ingesting and then delivering them costs least per item.

    The cost of putting an item from ``s`` on shard ``d`` is the link cost of ingesting it
    (``s -> d``) plus ``reads_per_write`` (items the learners fetch per item put, i.e. the replay
    ratio of the round) times the cost of delivering from ``d`` to its nearest learner. A shard
    takes at most its capacity in one round; cost levels are filled cheapest first over all
    sources, and a source's items are spread evenly over equally cheap shards. One of the
    candidates :class:`BandwidthAwarePlanner` weighs with the bandwidth model.

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


def expected_counts(
    sampling: str,
    requests: np.ndarray,
    sizes: np.ndarray,
    links: np.ndarray,
    gen: torch.Generator,
) -> np.ndarray:
    """Expected ``[learner, shard]`` delivery counts of a sampler over shards of ``sizes``."""
    if sampling == "stratified":
        return allocate_stratified(requests, sizes, 0, 0, gen, links).astype(np.float64)
    total = sizes.sum()
    if total == 0:
        return np.zeros((sizes.shape[0], sizes.shape[0]))
    return requests[:, None] * (sizes[None, :] / total)


class BandwidthAwarePlanner:
    """``bandwidth_aware`` placement: the candidate plan the bandwidth model predicts cheapest.

    For each round, three candidate plans are priced: ``local``, ``round_robin`` and
    :func:`plan_near_learners`. A candidate's price is the model's predicted time of its ingestion
    exchange plus the predicted time of the delivery exchange it leads to in steady state, where
    every shard it sends items to is full and the others keep their size (the sampler's expected
    counts over those sizes). The cheapest wins (ties in the order above), so by the model's own
    account ``bandwidth_aware`` is never slower than ``local`` or ``round_robin``. Inputs are the
    same on every rank (counts from the meta exchange, replicated sizes, the agreed model), so
    every rank computes the same plan. Decisions are memoised on the staged counts, the requests
    and the shards' fill (to a tenth).

    Args:
        model: the bandwidth model every rank agrees on.
        links: ``[world, world]`` link class index.
        learners: ``[world]`` bool, ranks that fetch.
        record_bytes: bytes per item.
        sampling: ``exact`` or ``stratified``.
    """

    CANDIDATES = ("local", "round_robin", "near_learners")

    def __init__(self, model, links, learners, record_bytes: int, sampling: str) -> None:
        self.model, self.links, self.learners = model, links, learners
        self.record_bytes, self.sampling = record_bytes, sampling
        self._gen = torch.Generator()
        self._memo: dict[bytes, str] = {}
        self.last: dict[str, float] = {}  # predicted seconds per candidate, last priced round

    def price(
        self, plan: np.ndarray, requests: np.ndarray, sizes: np.ndarray, capacities: np.ndarray
    ) -> float:
        """Predicted seconds of ingesting ``plan`` plus the steady-state delivery it leads to."""
        steady = np.where(plan.sum(axis=0) > 0, capacities, sizes).astype(np.float64)
        counts = expected_counts(self.sampling, requests, steady, self.links, self._gen)
        rb = self.record_bytes
        ingest = self.model.choose(plan * rb, self.links)[1] if plan.any() else 0.0
        deliver = self.model.choose(counts.T * rb, self.links)[1] if counts.any() else 0.0
        return ingest + deliver

    def plan(
        self,
        staged: np.ndarray,
        requests: np.ndarray,
        sizes: np.ndarray,
        capacities: np.ndarray,
        dealt: int,
    ) -> np.ndarray:
        """The cheapest candidate plan for this round (``int64 [world, world]``)."""
        fill = np.round(sizes / np.maximum(capacities, 1), 1)
        key = staged.tobytes() + requests.tobytes() + fill.tobytes()
        name = self._memo.get(key)
        if name is not None:  # the usual case in steady state: build only the chosen plan
            return self._candidate(name, staged, requests, capacities, dealt)
        plans = {
            k: self._candidate(k, staged, requests, capacities, dealt) for k in self.CANDIDATES
        }
        q = fill * capacities  # price on the memo key's rounded sizes
        self.last = {k: self.price(p, requests, q, capacities) for k, p in plans.items()}
        name = min(self.CANDIDATES, key=lambda k: self.last[k])
        if len(self._memo) > 4096:
            self._memo.clear()
        self._memo[key] = name
        return plans[name]

    def _candidate(
        self,
        name: str,
        staged: np.ndarray,
        requests: np.ndarray,
        capacities: np.ndarray,
        dealt: int,
    ) -> np.ndarray:
        if name != "near_learners":
            return plan_ingest(name, staged, dealt)
        replay = float(requests.sum()) / max(int(staged.sum()), 1)
        return plan_near_learners(
            staged, capacities, self.learners, self.links, reads_per_write=replay
        )
