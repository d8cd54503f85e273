"""One round of the data plane: meta exchange, ingestion, sampling allocation, delivery, weights.

A :class:`RoundRunner` owns the state every rank keeps identical (shard sizes, items ingested,
round-robin position) and this rank's shard. ``prepare`` snapshots what the round will move, in the
calling thread; the returned :class:`RoundTicket` can then run on any thread (inline in ``sync``
mode, on the scheduler's worker in ``overlap`` mode), as long as rounds run one at a time and in
the same order on every rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from conduit_dist.collectives.exchange import Exchange
from conduit_dist.collectives.transport import Transport
from conduit_dist.flow.versions import AgeBound
from conduit_dist.flow.weights import WeightsState
from conduit_dist.placement.base import Placement
from conduit_dist.records.buffers import OutputPool, RecordBuffer
from conduit_dist.records.spec import ExperienceSpec
from conduit_dist.rounds.fused import FusedRound
from conduit_dist.rounds.tickets import RoundStats, RoundTicket
from conduit_dist.rounds.wire import META as _META
from conduit_dist.rounds.wire import check_payload
from conduit_dist.sampling.base import Sampler
from conduit_dist.tiers import Shard


class RoundRunner:
    """Runs rounds for one plane.

    Args:
        spec: the record layout.
        shard: this rank's shard.
        exchange: the plane's collectives.
        sampler: what each learner gets (bound to the plane).
        placement: where staged items go (bound to the plane).
        weights_src: rank whose published weights are broadcast.
        device: where delivered batches live.
        transport: runs each exchange with the strategy the bandwidth model chooses.
        learners: the learner ranks (fused rounds carry learners' ``reduce`` payloads).
        reduce_numel: float32 elements of a fetch's ``reduce`` payload (0: none).
        wire_bytes: bytes of a delivered row (``None``: a stored record; samplers that
            deliver windows or trailers widen it, see ``Sampler.layout``).
        max_age: ``max_policy_age`` (``None``: none): stale oldest items are evicted at round
            start (``versions.AgeBound``).
    """

    def __init__(
        self,
        spec: ExperienceSpec,
        shard: Shard,
        exchange: Exchange,
        sampler: Sampler,
        placement: Placement,
        weights_src: int,
        device: torch.device,
        transport: Transport,
        learners: tuple[int, ...] = (),
        reduce_numel: int = 0,
        wire_bytes: int | None = None,
        max_age: int | None = None,
    ) -> None:
        self.spec, self.shard, self.exchange = spec, shard, exchange
        self.sampler, self.placement, self.transport = sampler, placement, transport
        self.rank, self.world = exchange.rank, exchange.world
        self.weights_src, self.device = weights_src, device
        self._requests = np.zeros(self.world, dtype=np.int64)  # this round's fetch sizes
        self._inflow = np.zeros(self.world, dtype=np.int64)  # items each shard got this round
        self.sizes = np.zeros(self.world, dtype=np.int64)  # every shard's size, on every rank
        self.published = self.sizes.copy()  # sizes as of the latest completed round
        self.ingested = 0  # items ingested over all ranks
        self.wire_bytes = wb = spec.record_bytes if wire_bytes is None else int(wire_bytes)
        self._send = RecordBuffer(wb, device)  # delivery
        self._recv = RecordBuffer(spec.record_bytes, device)  # ingestion
        self.outputs = OutputPool(wb, device, spec.unpack)
        self._dev_stage = RecordBuffer(spec.record_bytes, device)  # H2D copy of staged records
        self._meta_local = torch.zeros(_META + sampler.meta_width, dtype=torch.int64)
        # one-exchange rounds (see _fused): items stay where they were put and draws are i.i.d.,
        # so each shard sends every learner a header and candidates in a single all-to-all
        self.fusable = (
            self.world > 1
            and sampler.speculative
            and placement.keeps_local
            and self.device.type == "cpu"  # headers are parsed on the host: no device syncs
        )
        self.reduce_numel = int(reduce_numel)
        # the one-exchange round (fused_round.py): layout, candidate and update sizing; its
        # header: the meta values, the sampler's, this shard's size, whether a payload came
        self.fused = FusedRound(self, learners, _META + sampler.meta_width + 2)
        self._tags = sampler.trailer_bytes > 0
        self.ages = AgeBound(spec, max_age, device)
        self.limiter = None  # a RateLimiter (set by assembly): admits requests, counts samples
        self._windowed = sampler.windowed

    @property
    def fused_rounds(self) -> int:
        """Rounds that ran as one exchange (and delivered from it)."""
        return self.fused.rounds

    def _gather(self, slots: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the records at ``slots`` into ``out``; the sampler writes their trailers (or
        composes the rows: windows)."""
        if self._windowed:
            self.sampler.gather_windows(slots, out)
            return
        self.shard.gather(slots, out)
        if self._tags:
            self.sampler.tag(slots, out)

    def start(
        self, t: RoundTicket, weights: WeightsState
    ) -> Callable[[], tuple[torch.Tensor, RoundStats]]:
        """Run a one-exchange round up to its exchange, which is left in flight; returns the
        function that waits for it and finishes the round (``fusable`` planes only). Nothing
        else may touch the plane's shard or sampler in between (puts are staged meanwhile)."""
        cpu0 = time.thread_time()
        stats = RoundStats(round=t.round, newest=t.newest, newest_before=t.newest_before)
        flight = self.fused.start(t, stats)
        flight.early = True  # the caller works before the finish: its time is not the round's
        spent = time.thread_time() - cpu0

        def finish() -> tuple[torch.Tensor, RoundStats]:
            cpu1 = time.thread_time()
            out = self.fused.finish(flight, weights)
            return out, self._after(stats, cpu1 - spent)

        return finish

    def run(self, t: RoundTicket, weights: WeightsState) -> tuple[torch.Tensor, RoundStats]:
        """Run the round; returns this rank's delivered records (``[n, record_bytes]``)."""
        cpu0 = time.thread_time()
        stats = RoundStats(round=t.round, newest=t.newest, newest_before=t.newest_before)
        if self.world == 1:
            t.pack_deferred(self.spec)
            self.shard.settle()
            out = self._local(t, stats)
        elif self.fusable:
            out = self.fused.finish(self.fused.start(t, stats), weights)
        else:
            t0 = time.perf_counter()
            meta = self._meta(t)
            self._requests = meta[:, 1]
            self.sizes = self.sizes - meta[:, 4]  # items each shard evicted as stale
            self._ingest(t, meta[:, 0], t.round, stats)
            t1 = time.perf_counter()
            stats.mark("ingest", t0, t1)
            requests = self.admit(meta[:, 1], stats)
            counts = self.sampler.allocate(requests, self.sizes, t.round, meta[:, _META:])
            self.count_samples(counts)
            out = self._deliver(counts, t.round, stats, t1)
            self._take(counts)
            t3 = time.perf_counter()
            weights.exchange(self.exchange, meta, self.weights_src, t.round, t.weights)
            stats.mark("weights", t3, time.perf_counter())
            self.sampler.feedback(t.round)
        return out, self._after(stats, cpu0)

    def admit(self, requests: np.ndarray, stats: RoundStats) -> np.ndarray:
        """The requests the rate limiter lets through (all of them without one); marks the
        round ``limited`` when this rank's was held back."""
        lim = self.limiter
        if lim is None:
            return requests
        lim.inserted = self.ingested
        out = lim.admit(requests, int(self.sizes.sum()))
        stats.limited = bool(requests[self.rank] > 0 and out[self.rank] == 0)
        return out

    def count_samples(self, counts: np.ndarray) -> None:
        """Add the round's allocation to the limiter's replicated sample count."""
        if self.limiter is not None:
            self.limiter.sampled += int(counts.sum())

    def _take(self, counts: np.ndarray) -> None:
        """Items a queue delivered, or a finished rollout's, leave the store on every rank
        alike (``Sampler.taken``)."""
        taken = self.sampler.taken(counts)
        if taken is not None and taken.any():
            sh = self.shard
            (sh.take_newest if self.sampler.newest_first else sh.take_oldest)(int(taken[self.rank]))
            self.sizes = self.sizes - taken

    def _after(self, stats: RoundStats, cpu0: float) -> RoundStats:
        """After every round: start demotion, publish the sizes, close the stats."""
        self._demote_ahead()
        self.published = self.sizes.copy()  # what len(plane) reads: never a half-finished round
        stats.stored = self.shard.size if self.world == 1 else int(self.published.sum())
        stats.cpu_ms = (time.thread_time() - cpu0) * 1e3
        return stats

    def _demote_ahead(self) -> None:
        """Start the shard's background demotion for the next round; replicate its evictions
        (the shard says what every rank's demoter evicts; the next round waits for it)."""
        evicted = self.shard.ahead_evictions(self.sizes, self._inflow)
        if evicted is not None:
            self.shard.demote_ahead(int(self._inflow[self.rank]))
            self.sizes = self.sizes - evicted

    def _local(self, t: RoundTicket, stats: RoundStats) -> torch.Tensor:
        """World size 1: the same semantics with no collectives."""
        t0 = time.perf_counter()
        n_in = t.count + t.direct
        if t.direct:
            self.shard.commit(t.direct)
        if t.count:
            self.shard.append(self._staged_rows(t))
        self.ages.evict(self.shard, t.newest)
        self.sizes[0] = self.shard.size
        self._inflow[0] = n_in
        self.sampler.ingested(self._inflow)
        self.ingested += n_in
        t1 = time.perf_counter()
        stats.mark("ingest", t0, t1)
        size = self.shard.size
        local = self._meta_local.numpy()  # the sampler's values: at world size 1, its own
        local[_META:] = self.sampler.local_meta(self.shard)
        self._requests[0] = t.request
        requests = self.admit(self._requests, stats)
        counts = self.sampler.allocate(requests, self.sizes, t.round, local[None, _META:])
        self.count_samples(counts)
        n_out = int(counts[0, 0])
        out = self.outputs.acquire(n_out)
        if n_out:
            self._gather(self.sampler.draw(n_out, size, t.round), out)
        self._take(counts)
        self.sampler.feedback(t.round)
        stats.mark("sample", t1, time.perf_counter())
        rb = self.spec.record_bytes
        stats.items_in, stats.items_out, stats.bytes_in, stats.bytes_out = (
            n_in,
            n_out,
            n_in * rb,
            n_out * self.wire_bytes,
        )
        stats.add_sent([stats.bytes_in + stats.bytes_out])  # all local copies
        return out

    def check_payload(self, t: torch.Tensor) -> None:
        """Check a fetch's ``reduce`` payload (``ConfigError`` unless a contiguous CPU float32
        ``[reduce_numel]`` tensor; see ``fused.check_payload``)."""
        check_payload(t, self.reduce_numel)

    def _meta(self, t: RoundTicket) -> np.ndarray:
        """Exchange staged counts, requests and weight versions; local round set-up (packing
        donated batches, waiting for background demotion, the heartbeat) runs meanwhile."""
        local = self._meta_local.numpy()
        stale = 0
        if self.ages.max_age is not None:  # settled first: demotion must not be running
            t.pack_deferred(self.spec)
            self.shard.settle()
            stale = self.ages.evict(self.shard, t.newest)
            t.direct = self.ages.drop_direct(self.shard, t.direct, t.newest)
            self.ages.drop_staged(t.staged, t.newest)  # ingested after the meta: fresh only
            self.ages.drop_staged(t.device_staged, t.newest)
        n = t.count + t.direct  # direct: written into this shard's slots by put (local placement)
        local[:_META] = (n, t.request, t.weights.version, t.weights.nbytes, stale)
        local[_META:] = self.sampler.local_meta(self.shard)
        pending = self.exchange.all_gather_start(self._meta_local, t.round)
        try:
            self.exchange.arrive(t.round)
            t.pack_deferred(self.spec)
            self.shard.settle()
        finally:  # a started collective is always completed, even if local set-up failed
            meta = pending.wait()
        return meta.numpy().copy()  # the gather's buffer is reused next round

    def _staged_rows(self, t: RoundTicket) -> torch.Tensor:
        """This round's staged records on the plane's device, as one block of rows.

        Host staging (pinned on CUDA machines) is copied to the device on the round's stream;
        device staging (items put from GPU tensors) is used where it is, or, when both kinds
        were put, copied after it (FIFO within each kind).
        """
        host, dev = t.staged, t.device_staged
        if dev is None or not dev.count:
            inp = host.view()
            if inp.device == self.device:
                return inp
            return self._dev_stage.rows(host.count).copy_(inp, non_blocking=True)
        if not host.count:
            return dev.view()
        rows = self._dev_stage.rows(dev.count + host.count)
        rows[: dev.count].copy_(dev.view())
        rows[dev.count :].copy_(host.view(), non_blocking=True)
        return rows

    def _ingest(self, t: RoundTicket, counts: np.ndarray, r: int, stats: RoundStats) -> None:
        """Move staged items to their owner shards in one fused all-to-all."""
        plan = self.placement.plan(counts, self._requests, self.sizes, self.shard.capacity)
        inflow = plan.sum(axis=0)
        n_in = int(inflow[self.rank])
        if t.direct:  # put wrote them into the slots (items that stay local): counted now
            self.shard.commit(t.direct)
        if plan.any():  # every rank runs the exchange or none does (plan is replicated)
            stats.add_sent(plan[self.rank] * self.spec.record_bytes)  # own row: kept locally
            inp = self._staged_rows(t)
            if not _between_ranks(plan).any():
                self.shard.append(inp)  # every item stays put (known on every rank): no exchange
            else:
                direct = self.shard.receive_region(n_in)
                out = direct if direct is not None else self._recv.rows(n_in)
                stats.moves.append(self.transport.move(out, inp, plan, r, "ingest"))
                if direct is not None:
                    self.shard.commit(n_in)
                else:
                    self.shard.append(out)
        self.sizes = np.minimum(self.sizes + inflow, self.shard.capacity)
        self._inflow = inflow
        self.sampler.ingested(inflow)
        self.ingested += int(counts.sum())
        stats.items_in, stats.bytes_in = n_in, n_in * self.spec.record_bytes

    def _deliver(self, counts: np.ndarray, r: int, stats: RoundStats, t1: float) -> torch.Tensor:
        """Sample this shard's share of every learner's batch and deliver it in one exchange.

        A learner's rows from its own shard are gathered straight into its output (after the
        rows from other shards) and never enter the exchange; when no learner reads another
        rank's shard (e.g. ``stratified`` sampling over local placement) no collective runs.
        """
        if not counts.any():  # nobody fetches this round (actors' flushes, an empty store)
            stats.mark("sample", t1, t1)
            stats.mark("deliver", t1, t1)
            return self.outputs.acquire(0)
        me = self.rank
        to_learners = counts[:, me]  # rows this shard gives each learner
        mine = int(counts[me, me])
        first = int(to_learners[:me].sum())  # this learner's rows among this shard's draws
        n_draw, n_recv = int(to_learners.sum()), int(counts[me].sum())
        remote = n_recv - mine
        stats.add_sent(to_learners * self.wire_bytes)  # the own learner's rows: copied locally
        out = self.outputs.acquire(n_recv)
        send = self._send.rows(n_draw - mine)
        if n_draw:
            slots = self.sampler.draw(n_draw, int(self.shard.size), r)
            if mine:
                self._gather(slots[first : first + mine], out[remote:])
            if n_draw > mine:
                others = torch.cat([slots[:first], slots[first + mine :]]) if mine else slots
                self._gather(others, send)
        t2 = time.perf_counter()
        stats.mark("sample", t1, t2)
        rows = _between_ranks(counts.T)  # rows[shard, learner], own-shard rows already placed
        if rows.any():  # the same on every rank: all run the exchange or none does
            stats.moves.append(self.transport.move(out[:remote], send, rows, r, "deliver"))
        stats.mark("deliver", t2, time.perf_counter())
        stats.items_out, stats.bytes_out = n_recv, n_recv * self.wire_bytes
        return out

    def state_dict(self) -> dict[str, object]:
        """Sizes of every shard, items ingested, the sampler's and the placement's state, and
        what the next one-exchange round sizes its candidates and update rows from."""
        return {
            **self.fused.state_dict(),
            "requests": torch.from_numpy(self._requests.copy()),
            "sizes": torch.from_numpy(self.sizes.copy()),
            "ingested": self.ingested,
            "sampler": self.sampler.state_dict(),
            "placement": self.placement.state_dict(),
            "stale_evicted": self.ages.evicted,
            **({"limiter": self.limiter.state_dict()} if self.limiter is not None else {}),
        }

    def restore(self, state: dict[str, object], sizes: np.ndarray, exact: bool) -> None:
        """After a checkpoint restore (``checkpoint/restore.py``): every shard's new size, the
        items ingested and the rate limiter's counts (global), the stale evictions (this
        rank's, on the same world size); the next round sizes its candidates afresh."""
        self.sizes, self.published = sizes.copy(), sizes.copy()
        self.ingested = int(state["ingested"])
        self._requests = np.zeros(self.world, dtype=np.int64)
        self._inflow = np.zeros(self.world, dtype=np.int64)
        self.fused.cand = np.zeros((self.world, self.world), dtype=np.int64)
        self.fused.alloc = None
        self.ages.evicted = int(state.get("stale_evicted", 0)) if exact else 0
        if self.limiter is not None and "limiter" in state:
            self.limiter.load_state_dict(state["limiter"])

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore from :meth:`state_dict` (same world size; checked by the caller)."""
        self.sizes = state["sizes"].numpy().astype(np.int64).copy()
        self.published = self.sizes.copy()
        self.ingested = int(state["ingested"])
        self.fused.load_state_dict(state)
        self._requests = state["requests"].numpy().astype(np.int64).copy()
        self.sampler.load_state_dict(state["sampler"])
        self.placement.load_state_dict(state["placement"])
        self.ages.evicted = int(state.get("stale_evicted", 0))
        if self.limiter is not None and "limiter" in state:
            self.limiter.load_state_dict(state["limiter"])


def _between_ranks(matrix: np.ndarray) -> np.ndarray:
    """A copy of a ``[src, dst]`` count matrix without its diagonal (what a rank keeps itself)."""
    out = matrix.copy()
    np.fill_diagonal(out, 0)
    return out
