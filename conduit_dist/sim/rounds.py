"""One steady-state round of a workload on a declared machine, priced by the plane's own model.

Nothing here has a cost formula of its own. A simulated round builds the byte matrices the
plane's round would move, with the plane's own parts run on simulated shard sizes:

- which schedule: :func:`~conduit_dist.rounds.devices.plan_devices` of a CPU plane (``fused``
  where items stay where they were put, else ``general``);
- ingestion: the placement's ``plan`` (``round_robin``, ``bandwidth_aware`` with the model bound,
  ``local``);
- delivery: the sampler's ``allocate`` on the shard sizes after ingestion; on the fused schedule,
  the candidate rows :func:`~conduit_dist.rounds.wire.candidates` sizes from the sampler's shares,
  with the header rows and the gradient payload of :class:`~conduit_dist.rounds.wire.WireLayout`;
- every exchange priced as :class:`~conduit_dist.collectives.transport.Transport` prices it:
  ``BandwidthModel.choose`` (the meta gather: the fused all-to-all it always is), and a weights
  broadcast as the ring of one copy per rank that a pipelined broadcast moves;
- plus the plane's host bookkeeping per round (the topology's ``round_cpu_us``, and
  ``exchange_cpu_us`` for each further exchange, ``payload_gbps`` for a gradient payload), longer
  where a node has fewer cores than ranks (``cores_per_node``).

Overlap (``Workload.overlap``): a round launched at the backward on the plane's worker thread
hides up to ``backward_ms`` of itself; a round started by ``fetch_start`` (DQN's early start)
hides only its network exchanges (its bookkeeping and tier reads run on the caller's thread);
a sync round hides nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from conduit_dist.collectives.topology import LINKS
from conduit_dist.errors import ConfigError
from conduit_dist.flow.weights import parts
from conduit_dist.placement.base import PlacementContext
from conduit_dist.registry import PLACEMENTS, SAMPLERS, check_choice, check_count
from conduit_dist.rounds.devices import plan_devices
from conduit_dist.rounds.meta import MetaLayout
from conduit_dist.rounds.wire import candidates
from conduit_dist.sampling.base import SamplerContext, Speculative
from conduit_dist.sim.topology import SimTopology
from conduit_dist.tiers import KINDS

OVERLAPS = ("thread", "flight", "none")  # what of a round hides behind the backward
SIM_SAMPLERS = ("uniform",)  # allocators whose steady state depends on shard sizes alone
_CPU = torch.device("cpu")


@dataclass(frozen=True)
class Workload:
    """What every round of a job moves.

    Attributes:
        name: short name.
        record_bytes: bytes of a stored item.
        wire_bytes: bytes of a delivered row (0: ``record_bytes``; wider for windows).
        puts_per_rank: items each producing rank puts per round.
        batch_per_learner: items each learner fetches per round.
        learner_every: every ``k``-th rank learns (1: every rank, colocated).
        producers: ``all`` ranks put, or only the ``actors`` (ranks that do not learn).
        placement: ``local``, ``round_robin`` or ``bandwidth_aware``.
        sampler: one of :data:`SIM_SAMPLERS`.
        tier: the memory tier the shards keep items in (``device``, ``pinned``, ``host``,
            ``disk``); priced where the topology declares ``tier_gbps``.
        capacity_per_rank: items a shard holds (the store is simulated full).
        backward_ms: the learner's compute a round launched at its backward hides behind.
        overlap: what hides behind it: ``thread`` (the whole round, on the plane's worker
            thread: ``schedule="overlap"``), ``flight`` (only the exchanges; the bookkeeping
            runs on the caller's thread: ``fetch_start``, the main job's early start) or
            ``none`` (a sync round, all exposed).
        reduce_numel: float32 gradients riding in the round (``grad_sync=round``; 0: none).
        weights_bytes: bytes of the weights the learners publish (0: none).
        publish_every: rounds between publishes (the broadcast's cost is spread over them).
    """

    name: str
    record_bytes: int
    puts_per_rank: int
    batch_per_learner: int
    wire_bytes: int = 0
    learner_every: int = 1
    producers: str = "all"
    placement: str = "local"
    sampler: str = "uniform"
    tier: str = "device"
    capacity_per_rank: int = 100_000
    backward_ms: float = 0.0
    overlap: str = "thread"
    reduce_numel: int = 0
    weights_bytes: int = 0
    publish_every: int = 1
    notes: str = ""

    def __post_init__(self) -> None:
        where = f"workload {self.name!r}"
        for key, allowed in (("placement", PLACEMENTS), ("sampler", SIM_SAMPLERS),
                             ("tier", KINDS), ("overlap", OVERLAPS),
                             ("producers", ("all", "actors"))):  # fmt: skip
            check_choice(f"{where} {key}", getattr(self, key), allowed)
        for key in ("record_bytes", "batch_per_learner", "learner_every", "publish_every"):
            check_count(f"{where} {key}", getattr(self, key), 1)

    @property
    def row_bytes(self) -> int:
        """Bytes of a delivered row."""
        return self.wire_bytes or self.record_bytes


@dataclass
class Exchange:
    """One simulated exchange: its strategy, predicted seconds and bytes per link class."""

    op: str
    strategy: str
    seconds: float
    bytes_by_link: dict[str, int]
    terms: dict[str, float] = field(default_factory=dict)  # seconds of each model feature


@dataclass
class SimRound:
    """A simulated round of ``world`` ranks."""

    world: int
    schedule: str
    exchanges: list[Exchange] = field(default_factory=list)
    cpu_s: float = 0.0
    backward_s: float = 0.0
    overlap: str = "thread"

    @property
    def seconds(self) -> float:
        """The round's time: its exchanges, one after another, and its host bookkeeping."""
        return self.cpu_s + sum(e.seconds for e in self.exchanges)

    @property
    def exposed_s(self) -> float:
        """What the learner waits for with the round launched at its backward: the part over
        the backward (``thread``); the host work (bookkeeping, tier reads) plus the network
        exchanges' part over it (``flight``); or all of it (``none``)."""
        if self.overlap == "none":
            return self.seconds
        if self.overlap == "flight":
            host = self.cpu_s + sum(e.seconds for e in self.exchanges if e.strategy == "local")
            return host + max(0.0, self.seconds - host - self.backward_s)
        return max(0.0, self.seconds - self.backward_s)

    def dominant(self) -> tuple[str, str]:
        """The costliest exchange and the model's costliest term in it (``calls``, ``msgs``,
        or a link class's bytes), or the host bookkeeping."""
        if not self.exchanges or self.cpu_s >= max(e.seconds for e in self.exchanges):
            return "host bookkeeping", "round_cpu"
        e = max(self.exchanges, key=lambda x: x.seconds)
        return e.op, max(e.terms, key=e.terms.get)

    def bytes_by_link(self) -> dict[str, int]:
        """Bytes over each link class, summed over the round's exchanges (all ranks)."""
        out = dict.fromkeys(LINKS, 0)
        for e in self.exchanges:
            for link, n in e.bytes_by_link.items():
                out[link] += n
        return out


def _link_bytes(matrix: np.ndarray, links: np.ndarray) -> dict[str, int]:
    """Bytes over each link class (``self`` on the diagonal, as the plane's links are)."""
    own, host = int(np.trace(matrix)), int(np.where(links == 1, matrix, 0).sum())
    return dict(zip(LINKS, (own, host, int(matrix.sum()) - own - host), strict=True))


def simulate(topo: SimTopology, world: int, w: Workload, seed: int = 0, model=None) -> SimRound:
    """Simulate one steady-state round of ``w`` on ``world`` ranks of ``topo``.

    Args:
        topo: the machine.
        world: ranks.
        w: the workload.
        seed: the allocators' seed.
        model: the cost model (default: ``topo.model(world)``).

    Returns:
        The round: its exchanges with the strategies the model picks, seconds, bytes per link.

    Raises:
        ConfigError: a workload with no learner or no producer at this world size.
    """
    links = topo.links(world)
    model = model if model is not None else topo.model(world)
    learners = np.zeros(world, dtype=bool)
    learners[:: w.learner_every] = True
    producers = np.ones(world, dtype=bool) if w.producers == "all" else ~learners
    if not producers.any():
        raise ConfigError(f"workload {w.name!r}: no rank puts at world {world}")
    sampler = SAMPLERS[w.sampler]()
    sampler.bind(SamplerContext(seed, 0, world, links))
    placement = PLACEMENTS[w.placement]()
    placement.bind(PlacementContext(world, links, learners, w.record_bytes, model, sampler))
    staged = np.where(producers, w.puts_per_rank, 0).astype(np.int64)
    requests = np.where(learners, w.batch_per_learner, 0).astype(np.int64)
    cap = w.capacity_per_rank
    # the full store of the steady state: local keeps items on their producers, others spread
    full = producers if placement.keeps_local else np.ones(world, dtype=bool)
    sizes = np.where(full, cap, 0).astype(np.int64)
    schedule = plan_devices(
        device=_CPU, world=world, sampler=sampler, keeps_local=placement.keeps_local,
        rehearse=False,
    ).schedule  # fmt: skip
    r = SimRound(world, schedule, backward_s=w.backward_ms * 1e-3, overlap=w.overlap)
    head = MetaLayout().width * 8  # bytes of one rank's meta row / header
    rb = w.row_bytes
    if world == 1:
        r.cpu_s = bookkeeping_s(topo, world, 1, w.reduce_numel)
        return r
    if schedule == "fused":
        h_rows = -(-head // rb)
        pay_rows = -(-w.reduce_numel * 4 // rb) if w.reduce_numel else 0
        speculative = isinstance(sampler, Speculative)
        shares = sampler.shares(sizes, np.zeros((world, 0))) if speculative else np.zeros(world)
        cand = candidates(requests, shares, learners)  # [shard, learner] rows
        pay = np.outer(learners, learners) * pay_rows
        served = cand.sum(axis=1)  # rows each shard reads for the round, its own learner's too
        rows = h_rows + pay + cand
        np.fill_diagonal(rows, 0)
        _add(r, "all_to_all(round)", rows * rb, links, model, fixed="all_to_all")
    else:
        meta = np.full((world, world), head, dtype=np.int64)
        np.fill_diagonal(meta, 0)
        _add(r, "all_gather(meta)", meta, links, model, fixed="all_to_all")
        plan = placement.plan(staged, requests, sizes, cap)
        if plan.any():
            _add(r, "ingest", plan * w.record_bytes, links, model)
        sizes = np.minimum(sizes + plan.sum(axis=0), cap)
        if w.reduce_numel:  # the late header exchange carrying the payload between learners
            pay = np.outer(learners, learners) * (head + 4 * w.reduce_numel)
            np.fill_diagonal(pay, 0)
            _add(r, "all_to_all(headers)", pay, links, model, fixed="all_to_all")
        counts = sampler.allocate(requests, sizes, 0, np.zeros((world, 0)))
        served = counts.sum(axis=0)
        rows = counts.T.copy()
        np.fill_diagonal(rows, 0)
        if rows.any():
            _add(r, "deliver", rows * rb, links, model)
    r.cpu_s = bookkeeping_s(topo, world, len(r.exchanges), w.reduce_numel)
    r.exchanges += tier_reads(topo, w, served * rb, requests * rb)
    if w.weights_bytes:
        # as the DataPlane sends them: each learner's part to every rank that is not one
        m = weights_matrix(
            world, w.weights_bytes, np.flatnonzero(learners), np.flatnonzero(~learners)
        )
        ex = price_exchange("send(weights)", m, links, model, "p2p")
        ex.seconds /= w.publish_every
        r.exchanges.append(ex)
    return r


def weights_matrix(
    world: int, nbytes: int, owners: np.ndarray | list[int], receivers: np.ndarray | list[int]
) -> np.ndarray:
    """The byte matrix of the planes' weights transfer (``WeightsState.exchange``, schedule
    ``"p2p"``): owner ``i`` of ``len(owners)`` sends its part (``flow.weights.parts``) to each
    receiver other than itself."""
    m = np.zeros((world, world), dtype=np.int64)
    for src, (lo, hi) in zip(owners, parts(nbytes, len(owners))):
        for dst in receivers:
            if dst != src:
                m[src, dst] += hi - lo
    return m


def tier_reads(topo: SimTopology, w: Workload, served, landed) -> list[Exchange]:
    """The tier's part of a round, where the topology declares ``tier_gbps``: every shard
    reads the rows it serves at the tier's read GB/s (the slowest shard counts), and a batch
    held off the device crosses the host-to-device link (``h2d_gbps``) to its learner.

    Args:
        topo: the machine.
        w: the workload (its ``tier``).
        served: bytes each shard reads.
        landed: bytes each learner receives.

    Raises:
        ConfigError: a workload's tier the topology does not declare.
    """
    if not topo.tier_gbps:
        return []
    if w.tier not in topo.tier_gbps:
        raise ConfigError(
            f"workload {w.name!r} tier {w.tier!r}: topology {topo.name!r} declares tier_gbps "
            f"for {sorted(topo.tier_gbps)} only"
        )
    read = float(np.max(served)) / (topo.tier_gbps[w.tier][0] * 1e9)
    out = [Exchange(f"read({w.tier})", "local", read, {}, {"tier_read": read})]
    if w.tier != "device" and topo.h2d_gbps:
        h2d = float(np.max(landed)) / (topo.h2d_gbps * 1e9)
        out.append(Exchange("h2d(batch)", "local", h2d, {}, {"h2d": h2d}))
    return out


def bookkeeping_s(topo: SimTopology, world: int, exchanges: int, reduce_numel: int = 0) -> float:
    """Seconds of the plane's host work in a round of ``exchanges`` exchanges carrying
    ``reduce_numel`` float32 gradients (the topology's terms, times its oversubscription)."""
    us = topo.round_cpu_us + topo.exchange_cpu_us * max(0, exchanges - 1)
    if reduce_numel and topo.payload_gbps:
        us += reduce_numel * 4 / (topo.payload_gbps * 1e3)
    return us * 1e-6 * topo.oversubscription(world)


def price_exchange(
    op: str, matrix: np.ndarray, links: np.ndarray, model, fixed: str | None = None
) -> Exchange:
    """An exchange of ``matrix`` bytes priced as the plane's ``Transport`` prices it: the
    model's choice of strategy, or the ``fixed`` one (an exchange that is always that
    collective), with the seconds of each model term."""
    if fixed is not None:
        name, seconds = fixed, model.predict(fixed, matrix, links)
    else:
        name, seconds = model.choose(matrix, links)
    return Exchange(op, name, seconds, _link_bytes(matrix, links), model.terms(name, matrix, links))


def _add(r: SimRound, op: str, matrix, links, model, fixed: str | None = None) -> None:
    r.exchanges.append(price_exchange(op, matrix, links, model, fixed))
