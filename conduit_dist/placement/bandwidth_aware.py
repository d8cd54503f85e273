"""``bandwidth_aware`` placement: the candidate plan the bandwidth model prices cheapest."""

from __future__ import annotations

import numpy as np

from conduit_dist.placement.base import Placement, PlacementContext
from conduit_dist.placement.local import Local
from conduit_dist.placement.packed import first_per_host, host_ids, plan_packed
from conduit_dist.placement.round_robin import RoundRobin


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
    sources, and a source's items are spread evenly over equally cheap shards.

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
        at_level = np.isclose(cost, level)
        for src in np.nonzero(left)[0]:
            dsts = np.nonzero(at_level[src] & (room > 0))[0].tolist()
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


class BandwidthAware(Placement):
    """Prices candidate plans each round and takes the cheapest.

    The candidates are ``local``, ``round_robin``, :func:`plan_near_learners` and the packed plans
    (:func:`~conduit_dist.placement.packed.plan_packed`) of two families: ``learners/k`` stores
    on the first ``k`` learners of every host, ``producers/k`` on the first ``k`` ranks of every
    host that staged items this round, for every ``k`` up to a host's ranks (distinct sets of
    storing shards only, each taking at most ``capacity`` items a round). A candidate's price is
    the model's predicted time of its ingestion exchange plus the predicted time of the delivery
    exchange it leads to in steady state, where every shard it sends items to is full and the
    others keep their size (the sampler's expected counts over those sizes). The cheapest wins
    (ties in the order above), so by the model's own account ``bandwidth_aware`` is never slower
    than ``local`` or ``round_robin``. Inputs are replicated, so every rank computes the same
    plan. Decisions are memoised on the staged counts, the requests and the shards' fill (to a
    tenth); a memoised round builds only the chosen plan.

    Samplers that keep a stream's items on one shard (``Streams``) need a routing that never
    changes: streams stay where they were put until the first round in which items are staged
    and a learner fetches; that round's cheapest plan then fixes, for every rank, the shards its
    streams are dealt over (by key), for the rest of the run (the windows of a stream that moves
    then are cut once, at that round).
    """

    name = "bandwidth_aware"
    CANDIDATES = ("local", "round_robin", "near_learners")
    FAMILIES = ("learners", "producers")  # packed candidates "<family>/<k>"

    def __init__(self) -> None:
        self._rr, self._local = RoundRobin(), Local()
        self._memo: dict[bytes, str] = {}
        self.last: dict[str, float] = {}  # predicted seconds per candidate, last priced round
        self._hosts = np.zeros(0, dtype=np.int64)  # host id of every rank, set by bind
        self._streams: list[list[int]] | None = None  # each rank's stream shards, once fixed

    def bind(self, ctx: PlacementContext) -> None:
        """Attach to a plane (called once, when the plane is built)."""
        super().bind(ctx)
        self._hosts = host_ids(np.asarray(ctx.links))

    @classmethod
    def bound(
        cls, model, links: np.ndarray, learners: np.ndarray, record_bytes: int, sampler
    ) -> BandwidthAware:
        """A planner bound to a declared job (no plane): for benchmarks and what-if pricing.

        Args:
            model: the bandwidth model.
            links: ``[world, world]`` link classes.
            learners: ``[world]`` bool, ranks that fetch.
            record_bytes: bytes per item.
            sampler: a bound sampler (its expected allocation prices delivery).
        """
        planner = cls()
        planner.bind(
            PlacementContext(links.shape[0], links, learners, record_bytes, model, sampler)
        )
        return planner

    def price(
        self, plan: np.ndarray, requests: np.ndarray, sizes: np.ndarray, capacity: int
    ) -> float:
        """Predicted seconds of ingesting ``plan`` plus the steady-state delivery it leads to."""
        ctx = self.ctx
        steady = np.where(plan.sum(axis=0) > 0, capacity, sizes).astype(np.float64)
        counts = ctx.sampler.expected(requests, steady)
        rb = ctx.record_bytes
        ingest = ctx.model.choose(plan * rb, ctx.links)[1] if plan.any() else 0.0
        deliver = ctx.model.choose(counts.T * rb, ctx.links)[1] if counts.any() else 0.0
        return ingest + deliver

    def plan(
        self, staged: np.ndarray, requests: np.ndarray, sizes: np.ndarray, capacity: int
    ) -> np.ndarray:
        """The cheapest candidate plan for this round (``int64 [world, world]``)."""
        fill = np.round(sizes / max(capacity, 1), 1)
        key = staged.tobytes() + requests.tobytes() + fill.tobytes()
        name = self._memo.get(key)
        if name is not None:  # the usual case in steady state: build only the chosen plan
            chosen = self.candidate(name, staged, requests, capacity)
        else:
            names = self.names(staged, capacity)
            plans = {k: self.candidate(k, staged, requests, capacity) for k in names}
            q = fill * capacity  # price on the memo key's rounded sizes
            self.last = {k: self.price(p, requests, q, capacity) for k, p in plans.items()}
            name = min(names, key=lambda k: self.last[k])  # ties: the first in order
            if len(self._memo) > 4096:
                self._memo.clear()
            self._memo[key] = name
            chosen = plans[name]
        self._rr.advance(staged)
        return chosen

    def names(self, staged: np.ndarray, capacity: int) -> list[str]:
        """The candidates priced for ``staged``: :attr:`CANDIDATES`, then the packed ones.

        A packed candidate ``<family>/<k>`` is left out when it stores on the same shards as an
        earlier one, or when its shards would take more than ``capacity`` items each this round.
        """
        names = list(self.CANDIDATES)
        total = int(staged.sum())
        if total == 0:
            return names
        seen: set[bytes] = set()
        for family in self.FAMILIES:
            eligible = self._eligible(family, staged)
            for k in range(1, staged.shape[0] + 1):
                stores = first_per_host(eligible, self._hosts, k)
                if not stores.any():
                    break
                fits = -(-total // int(stores.sum())) <= capacity
                if fits and stores.tobytes() not in seen:
                    seen.add(stores.tobytes())
                    names.append(f"{family}/{k}")
                if (stores == eligible).all():  # every host's eligible ranks taken
                    break
        return names

    def candidate(
        self, name: str, staged: np.ndarray, requests: np.ndarray, capacity: int
    ) -> np.ndarray:
        """One candidate's plan: one of :attr:`CANDIDATES` or ``<family>/<k>`` (see the class).

        Raises:
            ValueError: on an unknown candidate name.
        """
        if name == "local":
            return self._local.plan(staged, requests, staged, capacity)
        if name == "round_robin":
            return self._rr.peek(staged)
        if name == "near_learners":
            world = staged.shape[0]
            replay = float(requests.sum()) / max(int(staged.sum()), 1)
            return plan_near_learners(
                staged,
                np.full(world, capacity, dtype=np.int64),
                self.ctx.learners,
                self.ctx.links,
                reads_per_write=replay,
            )
        family, _, k = name.partition("/")
        if family not in self.FAMILIES or not k.isdigit() or int(k) < 1:
            raise ValueError(
                f"BandwidthAware.candidate name: expected one of {list(self.CANDIDATES)} or "
                f"'<family>/<k>' with family in {list(self.FAMILIES)} and k >= 1, got {name!r}"
            )
        stores = first_per_host(self._eligible(family, staged), self._hosts, int(k))
        return plan_packed(staged, stores, self.ctx.links)

    def _eligible(self, family: str, staged: np.ndarray) -> np.ndarray:
        return self.ctx.learners.astype(bool) if family == "learners" else staged > 0

    def observe(
        self, staged: np.ndarray, requests: np.ndarray, sizes: np.ndarray, capacity: int
    ) -> None:
        """Fix the stream routing at the first round that stages items and fetches: each rank's
        streams are dealt over the shards the cheapest plan of that round sends its items to."""
        if self._streams is not None or not staged.any() or not requests.any():
            return
        plan = self.plan(staged, requests, sizes, capacity)
        self._streams = [np.flatnonzero(plan[s]).tolist() or [s] for s in range(len(staged))]

    def route(self, src: int, keys: np.ndarray) -> np.ndarray:
        """Stream ``k`` of rank ``src``: its fixed shards' ``k % n``-th (before the routing is
        fixed: the rank's own shard)."""
        if self._streams is None:
            return super().route(src, keys)
        dests = np.asarray(self._streams[src], dtype=np.int64)
        return dests[keys.astype(np.int64) % dests.shape[0]]

    def state_dict(self) -> dict[str, object]:
        """The round-robin candidate's remainder position and the fixed stream routing."""
        return {**self._rr.state_dict(), "streams": self._streams or []}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict`."""
        self._rr.load_state_dict(state)
        self._streams = [list(d) for d in state["streams"]] or None
