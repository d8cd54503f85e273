"""The round engine: one sequence of named steps, each written once, run as three schedules.

Steps: ``prepare`` -> ``meta`` -> ``plan`` -> ``ingest`` -> ``headers`` (when needed) ->
``allocate`` (with the rate limiter's admission) -> ``deliver`` -> ``take`` -> ``weights`` ->
``after``, then ``land`` (rows composed on the host move to a CUDA learner). Schedules and the rows
device, chosen once (``devices.plan_devices``): ``local`` (world size 1: no collective), ``fused``
(items stay where they were put: one header exchange carries every rank's meta, payloads, update
rows and, on host rows, candidates) and ``general`` (meta exchange, plan, ingestion exchange, the
header exchange when the sampler reports shard values, routes feedback or a payload rides,
delivery). On device rows the headers stay on the host and carry no rows; the rows move in the
ingestion and exact delivery exchanges, on the rows' device, and a payload is all-reduced there.
docs/round.md and docs/architecture.md draw and describe each step. Every rank keeps the
replicated state and runs rounds one at a time, in the same order; a ``RoundTicket`` prepared on
the thread that owns ``put`` can run on any thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from conduit_dist.errors import SpecError
from conduit_dist.rounds import meta as M
from conduit_dist.rounds.delivery import Delivery
from conduit_dist.rounds.devices import DevicePlan
from conduit_dist.rounds.headers import HeaderExchange
from conduit_dist.rounds.ingest import Ingest
from conduit_dist.rounds.meta import MetaLayout
from conduit_dist.rounds.state import Replicated
from conduit_dist.rounds.tickets import RoundStats, RoundTicket
from conduit_dist.rounds.wire import Flight, check_payload
from conduit_dist.sampling.base import (
    ReadsColumns,
    ReportsMeta,
    RoutesFeedback,
    Speculative,
    Streams,
    Takes,
    TracksInflow,
    WritesRows,
)


class RoundEngine:
    """Runs one plane's rounds.

    Args:
        spec: the stored records' layout.
        storage: this rank's shard (a ``Storage``).
        exchange: the plane's collectives.
        sampler: what each learner gets (bound and attached).
        placement: where staged items go (bound).
        transport: runs each exchange with the strategy the bandwidth model chooses.
        flow: ``(ages, limiter)``: the ``max_policy_age`` guard (``versions.AgeBound``) and the
            rate limiter (or ``None``).
        learners: the learner ranks (those at the first's version send its weights).
        plan: where tiers, rows and collectives go (``devices.plan_devices``).
        wire_bytes: bytes of a delivered row.
        reduce_numel: float32 elements of a fetch's ``reduce`` payload (0: none).
    """

    def __init__(
        self, spec, storage, exchange, sampler, placement, transport, flow,
        learners: tuple[int, ...], plan: DevicePlan, wire_bytes: int, reduce_numel: int = 0,
    ) -> None:  # fmt: skip
        self.spec, self.storage, self.ex = spec, storage, exchange
        self.sampler, self.placement = sampler, placement
        self.ages, self.limiter = flow
        self.rank, self.world = exchange.rank, exchange.world
        self.devices, device = plan, plan.device
        self.device, self.wire_bytes, self.reduce_numel = device, wire_bytes, int(reduce_numel)
        self.learners = tuple(learners)  # each publishes its part of a version's weights
        self.schedule, self.rows_device = plan.schedule, plan.rows
        rows = self.rows_device
        # a payload all-reduced by the group on its device (device planes), not in the headers
        self.allreduce = plan.payload == "allreduce"
        head_numel = 0 if self.allreduce else self.reduce_numel
        # the sampler's capabilities, checked once (isinstance on a protocol costs ~1 us)
        self._streams, self._takes = isinstance(sampler, Streams), isinstance(sampler, Takes)
        self._tracks = isinstance(sampler, TracksInflow)
        self._shares = isinstance(sampler, Speculative)
        self.routed = self._streams and self.schedule == "general"
        width = sampler.meta_width if isinstance(sampler, ReportsMeta) else 0
        self.layout = MetaLayout(width, self.world if self.routed else 0)
        self.state = Replicated(self.world)  # every shard's size etc., the same on every rank
        self.from_candidates = 0  # rounds whose batches came from the header exchange
        write = sampler.write_rows if isinstance(sampler, WritesRows) else storage.gather
        # device rows: the sampler keeps a host copy of the few columns its bookkeeping reads
        reads = sampler.ingested_rows if isinstance(sampler, ReadsColumns) else None
        self.ingest = Ingest(
            storage, exchange, transport, spec.record_bytes, rows,
            reads if sampler.ctx.device_rows else None,
        )  # fmt: skip
        self.delivery = Delivery(
            sampler, write, exchange, transport, wire_bytes, (rows, device), spec.unpack
        )
        # host rows delivered to a host learner: a batch may be a view of the received rows
        self._zero_copy = torch.device(rows).type == "cpu" and not self.delivery.landing.moves
        is_learner = np.zeros(self.world, dtype=bool)
        is_learner[list(learners)] = True
        self.headers = HeaderExchange(
            exchange, sampler, write, is_learner, self.layout.width, wire_bytes, head_numel,
            torch.device("cpu"), plan.candidates,
        )  # fmt: skip
        # the general schedule's header exchange: after ingestion, for what the sampler reports
        # of its shard, feedback it routes, or a payload riding the headers
        self.late_headers = self.schedule == "general" and (
            width > 0 or isinstance(sampler, RoutesFeedback) or head_numel > 0
        )
        self._row = np.zeros((1, self.layout.width), dtype=np.int64)  # meta row (reused)
        self._routes: np.ndarray | None = None  # this round's items per destination (routed)
        self._meta_t = torch.from_numpy(self._row[0])
        self._zeros: torch.Tensor | None = None  # an all-reduced payload of a rank without one

    def check_payload(self, t: torch.Tensor) -> None:
        """Check a fetch's ``reduce`` payload (see ``wire.check_payload``): on the plane's
        device where it is all-reduced there, else in host memory."""
        check_payload(t, self.reduce_numel, self.device if self.allreduce else None)

    # ------------------------------------------------------------------ running rounds

    def run(self, t: RoundTicket, weights) -> tuple[torch.Tensor, RoundStats]:
        """Run the round; returns this rank's delivered rows (``[n, wire_bytes]``) and stats."""
        cpu0 = time.thread_time()
        stats = RoundStats(round=t.round, newest=t.newest, newest_before=t.newest_before)
        stats.thread = threading.current_thread().name
        if self.schedule == "local":
            out = self._local(t, stats)
        elif self.schedule == "fused":
            out = self._finish(self._launch(t, stats), weights)
        else:
            out = self._general(t, stats, weights)
        return self.delivery.landing.land(out), self._after(stats, cpu0)

    def start(self, t: RoundTicket, weights) -> Callable[[], tuple[torch.Tensor, RoundStats]]:
        """Run a fused round up to its exchange, left in flight; returns the function that
        waits for it and finishes the round, with a ``poll()`` attribute the caller calls
        between its own steps (it notes the exchange still in flight: that time is hidden).
        Nothing else may touch the shard or sampler in between (puts are staged meanwhile)."""
        cpu0 = time.thread_time()
        stats = RoundStats(round=t.round, newest=t.newest, newest_before=t.newest_before)
        flight = self._launch(t, stats)
        flight.early = True  # the caller works before the finish: its time is not the round's
        spent = time.thread_time() - cpu0

        def finish() -> tuple[torch.Tensor, RoundStats]:
            cpu1 = time.thread_time()
            out = self._finish(flight, weights)
            return self.delivery.landing.land(out), self._after(stats, cpu1 - spent)

        finish.poll = flight.poll  # the caller notes, between its steps, that it still runs
        return finish

    # ------------------------------------------------------------------ schedules

    def _local(self, t: RoundTicket, stats: RoundStats) -> torch.Tensor:
        """World size 1: the same steps with no collective."""
        t0 = time.perf_counter()
        self.prepare(t)
        n_in = self.ingest_local(t)
        meta = self.meta_row(t, n_in, self.evict(t))
        self.ingested_locally(meta)
        t1 = time.perf_counter()
        stats.mark("ingest", t0, t1)
        stats.items_in, stats.bytes_in = n_in, n_in * self.spec.record_bytes
        counts = self.allocate(meta[:, M.REQUEST], meta, t.round, stats)
        out = self.delivery.exact(counts, t.round, stats, t1)
        self.take(counts)
        stats.add_sent([stats.bytes_in + stats.bytes_out])  # all local copies
        return out

    def _launch(self, t: RoundTicket, stats: RoundStats) -> Flight:
        """Fused: everything up to the header exchange, which is launched and left in flight."""
        t0 = time.perf_counter()
        self.ex.arrive(t.round)
        self.prepare(t)
        n_in = self.ingest_local(t)
        self.meta_row(t, n_in, self.evict(t), into=self.headers.head)
        stats.items_in, stats.bytes_in = n_in, n_in * self.spec.record_bytes
        f = self.headers.launch(t, stats, t0)
        stats.sent[self.rank] += n_in * self.spec.record_bytes  # own items: a local copy
        return f

    def _finish(self, f: Flight, weights) -> torch.Tensor:
        """Fused: land the header exchange, allocate, deliver, broadcast weights."""
        t, stats = f.ticket, f.stats
        if f.early:
            f.poll()  # still running when the fetch came: all of its span so far was hidden
        t_wait = time.perf_counter()
        meta = self.headers.land(f)
        self.ingested_locally(meta)
        t1 = time.perf_counter()
        if f.early:
            stats.mark("ingest", t_wait, t1)  # the span the fetch waited; ms: set-up + wait
            stats.ingest_ms = (f.launched - f.t0 + t1 - t_wait) * 1e3
            # ran behind the caller: to the last sighting in flight, or to the exchange's
            # completion where its transport says when (fetch_timing clamps to the fetch)
            done = f.work.completed_at()
            end = f.seen_in_flight if done is None else max(f.seen_in_flight, done)
            stats.flight = (f.launched, end)
        else:
            stats.mark("ingest", f.t0, t1)
        self.average_payload(t, meta)
        counts = self.allocate(meta[:, M.REQUEST], meta, t.round, stats)
        out = self.deliver(f, counts, t.round, stats, t1)
        if t.enqueued is not None:  # its NCCL work is enqueued: a waiting backward goes on
            t.enqueued.set()
        self.take(counts)
        self.broadcast_weights(meta, t, weights, stats)
        return out

    def _general(self, t: RoundTicket, stats: RoundStats, weights) -> torch.Tensor:
        """Meta exchange, plan, ingestion, (header exchange,) delivery, weights."""
        t0 = time.perf_counter()
        meta = self.exchange_meta(t)
        requests = meta[:, M.REQUEST].copy()
        self.average_payload(t, meta)  # on the device, while the host plans
        self.state.remove(meta[:, M.STALE])
        plan = self.plan(meta, requests)
        n_in = self.ingest.exchange(t, plan, stats)
        self.ingested_by_plan(plan)
        stats.items_in, stats.bytes_in = n_in, n_in * self.spec.record_bytes
        f = None
        if self.late_headers:  # what the sampler reports now that the round's items are in
            self.meta_row(t, n_in, 0, into=self.headers.head)
            f = self.headers.launch(t, stats, t0)
            meta = self.headers.land(f)
        t1 = time.perf_counter()
        stats.mark("ingest", t0, t1)
        counts = self.allocate(requests, meta, t.round, stats)
        out = self.deliver(f, counts, t.round, stats, t1)
        if t.enqueued is not None:  # its NCCL work is enqueued: a waiting backward goes on
            t.enqueued.set()
        self.take(counts)
        self.broadcast_weights(meta, t, weights, stats)
        return out

    # ------------------------------------------------------------------ steps

    def prepare(self, t: RoundTicket) -> None:
        """Pack donated puts, wait for background demotion, and with ``max_policy_age`` drop
        staged (and written-ahead) items below the bound before they are ingested."""
        t.pack_deferred(self.spec)
        self.storage.settle()
        ages = self.ages
        if ages.max_age is not None:
            t.direct = ages.drop_direct(self.storage, t.direct, t.newest)
            ages.drop_staged(t.staged, t.newest)
            ages.drop_staged(t.device_staged, t.newest)

    def evict(self, t: RoundTicket) -> int:
        """With ``max_policy_age``: take the shard's stale oldest items out; returns how many
        (the meta says it to every rank). Where items are ingested locally this runs after
        the commit: rows written ahead over the oldest slots have replaced those items."""
        return self.ages.evict(self.storage, t.newest) if self.ages.max_age is not None else 0

    def meta_row(self, t: RoundTicket, n_in: int, stale: int, into=None) -> np.ndarray:
        """This rank's meta row (``into``: a header to fill in place; else ``[1, width]``),
        with the sampler's values once the round's items are in."""
        row = self._row[0] if into is None else into
        routed = self._routes if self.routed else None
        sampler = self.sampler.local_meta() if self.layout.sampler_width else ()
        w = t.weights
        self.layout.fill(
            row, n_in, t.request, w.version, w.nbytes, stale, self.storage.size,
            t.reduce is not None, sampler, routed, w.shard_head,
        )  # fmt: skip
        return self._row

    def exchange_meta(self, t: RoundTicket) -> np.ndarray:
        """General: exchange every rank's meta row. Without an age bound or routing, the local
        set-up (packing donated puts, waiting for demotion, the heartbeat) runs while it is in
        flight."""
        early = self.ages.max_age is not None or self.routed
        stale = 0
        if early:
            self.prepare(t)
            stale = self.evict(t)
        if self.routed:
            self._routes = self.ingest.route(t, self.sampler.stream_keys, self.placement.route)
        w, routes = t.weights, self._routes if self.routed else None
        staged = t.count + t.direct
        payload = self.allreduce and t.reduce is not None  # all-reduced: said here, not later
        self.layout.fill(
            self._row[0], staged, t.request, w.version, w.nbytes, stale, 0, payload, (), routes,
            w.shard_head,
        )  # fmt: skip
        pending = self.ex.all_gather_start(self._meta_t, t.round)
        try:
            self.ex.arrive(t.round)
            if not early:
                self.prepare(t)
        finally:  # a started collective is always completed, even if local set-up failed
            meta = pending.wait()
        return meta.numpy().copy()  # the gather's buffer is reused next round

    def average_payload(self, t: RoundTicket, meta: np.ndarray) -> None:
        """Device planes: the learners' payloads averaged by one all-reduce on the group, on the
        payload's device (ranks without a payload add zeros), in place; the same values on
        every learner. Every rank runs it when any rank has a payload (the meta says)."""
        if not self.allreduce:
            return
        have = int(np.count_nonzero(meta[:, M.PAYLOAD]))
        if have == 0:
            return
        buf = t.reduce
        if buf is None:  # this rank adds nothing: zeros of the payload's size, reused
            buf = self._zeros
            if buf is None:
                buf = self._zeros = torch.zeros(self.reduce_numel, device=self.device)
            buf.zero_()
        else:
            self.check_payload(buf)
        group = self.ex.group
        self.ex.run(
            lambda: dist.all_reduce(buf, group=group, async_op=True), "all_reduce(payload)",
            t.round, cuda=buf.is_cuda,
        )  # fmt: skip
        if t.reduce is not None and have > 1:
            t.reduce.mul_(1.0 / have)

    def plan(self, meta: np.ndarray, requests: np.ndarray) -> np.ndarray:
        """``send[src, dst]`` this round (the same on every rank): the routed counts from the
        meta, or the placement's plan of the staged counts."""
        staged = meta[:, M.STAGED].copy()
        cap = self.storage.capacity
        if self.routed:
            self.placement.observe(staged, requests, self.state.sizes, cap)
            return self.layout.routed(meta).copy()
        return self.placement.plan(staged, requests, self.state.sizes, cap)

    def ingest_local(self, t: RoundTicket) -> int:
        """Fused and local schedules: this shard takes in its own staged items (before its meta
        row: the sampler's values count them)."""
        n_in = self.ingest.local(t)
        if self._streams:
            own = np.zeros(self.world, dtype=np.int64)
            own[self.rank] = n_in
            self.sampler.arrived(own)
        return n_in

    def ingested_locally(self, meta: np.ndarray) -> None:
        """Fused and local schedules: every shard took in its own staged items; the headers
        carry every shard's size."""
        self._ingested(meta[:, M.STAGED].copy(), meta[:, M.SIZE].copy())

    def ingested_by_plan(self, plan: np.ndarray) -> None:
        """General: every shard took in its column of the plan."""
        inflow = plan.sum(axis=0)
        if self._streams:
            self.sampler.arrived(plan[:, self.rank].copy())
        self._ingested(inflow, np.minimum(self.state.sizes + inflow, self.storage.capacity))

    def _ingested(self, inflow: np.ndarray, sizes: np.ndarray) -> None:
        self.state.ingested_now(inflow, sizes)
        if self._tracks:
            self.sampler.ingested(inflow)

    def allocate(
        self, requests: np.ndarray, meta: np.ndarray, round: int, stats: RoundStats
    ) -> np.ndarray:
        """The round's ``[learner, shard]`` counts (identical on every rank) of the requests the
        rate limiter admits (marking the round ``limited`` when this rank's was held back);
        sizes the next round's candidates and update rows."""
        sizes, lim, sampler_meta = self.state.sizes, self.limiter, self.layout.sampler(meta)
        admitted = requests
        if lim is not None:
            lim.inserted = self.state.ingested
            admitted = lim.admit(requests, int(sizes.sum()))
            stats.limited = bool(requests[self.rank] > 0 and admitted[self.rank] == 0)
        counts = self.sampler.allocate(admitted, sizes, round, sampler_meta)
        if lim is not None:
            lim.sampled += int(counts.sum())
        if self.schedule == "fused" or self.late_headers:
            shares = self.sampler.shares(sizes, sampler_meta) if self._shares else None
            self.headers.allocated(counts, requests, shares)
        return counts

    def deliver(
        self, f: Flight | None, counts: np.ndarray, round: int, stats: RoundStats, t1: float
    ) -> torch.Tensor:
        """This learner's batch: a prefix of each peer's candidates and its own shard's share
        when the header exchange covered the allocation, else the exact delivery."""
        if f is None or not self.headers.covers(f, counts):
            return self.delivery.exact(counts, round, stats, t1)
        self.from_candidates += 1
        n = sum(counts[self.rank].tolist())
        # a remote learner whose batch is one peer's candidates, landing where it was received
        # (host rows, a host learner): that block itself, no copy of the batch
        out = self.headers.one_block(f, counts) if self._zero_copy else None
        if out is not None:
            at = n
        else:
            out = self.delivery.rows.acquire(n)
            at = self.headers.take(f, counts, out)
            self.delivery.own(counts, round, out, at)
        stats.sent[self.rank] += (n - at) * self.wire_bytes  # the own share: a local copy
        t2 = time.perf_counter()
        stats.mark("sample", t1, t2)
        stats.mark("deliver", t2, t2)  # the rows arrived with the headers
        stats.items_out, stats.bytes_out = n, n * self.wire_bytes
        return out

    def take(self, counts: np.ndarray) -> None:
        """Items a queue delivered, or a finished rollout's, leave the store on every rank
        alike (``Takes``)."""
        if not self._takes:
            return
        taken = self.sampler.taken(counts)
        if taken is not None and taken.any():
            st = self.storage
            (st.take_newest if self.sampler.newest_first else st.take_oldest)(int(taken[self.rank]))
            self.state.remove(taken)

    def broadcast_weights(self, meta: np.ndarray, t: RoundTicket, weights, stats) -> None:
        """Send the first learner's newer version if it published one: every learner that holds
        the same version (each packs it whole) sends a part of it to every rank that does not,
        except learners already past it (``WeightsState.exchange``), so no learner sends it all
        while learners publish in step."""
        t3 = time.perf_counter()
        cols = [M.VERSION, M.WBYTES, M.WSHARD]
        ref = meta[self.learners[0], cols]
        owners = [r for r in self.learners if (meta[r, cols] == ref).all()]
        version, nbytes, sharded = int(ref[0]), int(ref[1]), int(ref[2])
        if sharded and len(owners) != len(self.learners):  # the same meta: raised on every rank
            behind = [r for r in self.learners if r not in owners]
            raise SpecError(
                f"round {t.round}: the learners publish a sharded (FSDP2) state, but learner "
                f"ranks {behind} published another version than learner {self.learners[0]} "
                f"({version}): expected every holder of a shard to publish each version at "
                "the same point (no shard can be left out of a version)"
            )
        # every other rank, but a learner already past that version (it published more)
        receivers = [
            r for r in range(self.world)
            if r not in owners and not (r in self.learners and meta[r, M.VERSION] > version)
        ]  # fmt: skip
        weights.exchange(
            self.ex, owners, version, nbytes, t.round, t.weights, 0, receivers, (), sharded
        )
        stats.mark("weights", t3, time.perf_counter())

    def _after(self, stats: RoundStats, cpu0: float) -> RoundStats:
        """After every round: start demotion, publish the sizes, close the stats."""
        st = self.state
        evicted = self.storage.ahead_evictions(st.sizes, st.inflow)
        if evicted is not None:  # every rank knows what every shard's demoter evicts
            self.storage.demote_ahead(int(st.inflow[self.rank]))
            st.remove(evicted)
        stats.stored = st.publish()  # what plane.stored reads: never a half-finished round
        stats.cpu_ms = (time.thread_time() - cpu0) * 1e3
        return stats

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, object]:
        """The replicated store state and what the next header exchange sizes its candidates
        and update rows from."""
        return {**self.state.state_dict(), "headers": self.headers.state_dict()}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict` (same world size; checked by the caller)."""
        self.state.load_state_dict(state)
        self.headers.load_state_dict(state["headers"])

    def restore(self, sizes: np.ndarray, ingested: int) -> None:
        """After a checkpoint restore onto any world size: every shard's new size and the items
        ingested; the next round sizes its candidates afresh."""
        self.state.restore(sizes, ingested)
        self.headers.reset()
