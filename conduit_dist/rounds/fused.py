"""The one-exchange round (``RoundRunner.fusable`` planes): meta, ingestion and delivery in one
``all_to_all_single`` (wire layout in ``fused.py``; docs/architecture.md, "One-exchange rounds").

A :class:`FusedRound` keeps what such rounds size themselves from, replicated on every rank:
the candidate rows each shard sends each learner and the last allocation (the update rows'
room). It reads and updates the runner's replicated state (requests, sizes, inflow).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from conduit_dist.flow.weights import WeightsState
from conduit_dist.rounds.tickets import RoundStats, RoundTicket
from conduit_dist.rounds.wire import META as _META
from conduit_dist.rounds.wire import Flight, FusedLayout, candidates, short


class FusedRound:
    """One plane's one-exchange rounds.

    Args:
        run: the plane's ``RoundRunner`` (its shard, sampler, exchange and replicated state).
        learners: the learner ranks.
        head_len: int64 values in a header.
    """

    def __init__(self, run, learners: tuple[int, ...], head_len: int) -> None:
        self.run, world = run, run.world
        self.learners = np.zeros(world, dtype=bool)
        self.learners[list(learners)] = True
        self.layout = FusedLayout(
            run.wire_bytes, run.rank, self.learners, head_len, run.reduce_numel, run.device
        )
        self.rounds = 0  # rounds that ran as one exchange (and delivered from it)
        # candidate rows [shard, learner] of the next round (sized from this one's)
        self.cand = np.zeros((world, world), dtype=np.int64)
        self.alloc: np.ndarray | None = None  # last round's allocation (update rows' room)

    def start(self, t: RoundTicket, stats: RoundStats) -> Flight:
        """A round in one ``all_to_all_single`` (``fusable`` planes; layout in ``fused.py``), up
        to its exchange, launched and left in flight (:meth:`finish` completes it).

        Every rank ingests its staged items into its own shard, then sends each peer its header
        and, when the peer is a learner, candidate rows drawn i.i.d. from this shard: that
        learner's last request times this shard's last share of the draws, plus a margin
        (``fused.candidates``; known to every rank). After the exchange every rank holds every
        header, so the allocation is the same everywhere; a learner takes the first ``k``
        candidates of each shard's block (a prefix of i.i.d. draws is i.i.d.: the batch has the
        distribution the three-exchange round draws) and draws its own shard's share then. When
        some learner's share from a shard exceeds what that shard sent (its fetch grew, the
        first fetch, a jump in a share), every rank knows it from the headers and the round
        finishes with the ordinary delivery exchange.
        """
        run, r, lay = self.run, t.round, self.layout
        t0 = time.perf_counter()
        run.exchange.arrive(r)
        t.pack_deferred(run.spec)
        shard, sampler = run.shard, run.sampler
        shard.settle()
        if t.direct:  # written into the slots by put
            shard.commit(t.direct)
        if t.count:
            shard.append(run._staged_rows(t))
        stale = run.ages.evict(shard, t.newest)  # the header's size says it to every rank
        size = int(shard.size)
        head = lay.head.numpy()
        head[:_META] = (t.count + t.direct, t.request, t.weights.version, t.weights.nbytes, stale)
        head[_META:-2] = sampler.local_meta(shard)
        head[-2:] = (size, t.reduce is not None)
        cand = self.cand  # sized from the last round's requests and shares
        n_cand = int(cand[run.rank].sum())  # the own-shard share is drawn once known (finish)
        drawable = size and n_cand and sampler.drawable()  # else nothing reads them
        slots = sampler.draw(n_cand, size, r) if drawable else None
        budgets = lay.set_updates(self.alloc if sampler.routes_updates else None)
        updates = sampler.outgoing(budgets) if budgets else None
        send, in_splits = lay.pack(cand, t.reduce, run._gather, slots, updates)
        recv, out_splits = lay.recv_rows(cand)
        sent = np.asarray(in_splits, dtype=np.int64) * lay.rb
        sent[run.rank] += (t.count + t.direct) * run.spec.record_bytes  # own items: a local copy
        stats.add_sent(sent)
        work = run.exchange.all_to_all_async(
            recv, send, out_splits, in_splits, r, "all_to_all(round)"
        )
        return Flight(t, stats, t0, cand, recv, work, time.perf_counter())

    def finish(self, f: Flight, weights: WeightsState) -> torch.Tensor:
        """Wait for a fused round's exchange and finish the round: headers, payload average,
        allocation, this learner's batch, weights."""
        run, lay, t, stats, cand = self.run, self.layout, f.ticket, f.stats, f.cand
        me, sampler = run.rank, run.sampler
        r, t0 = t.round, f.t0
        t_wait = time.perf_counter()
        f.work.wait()
        meta, payloads, blocks, updates = lay.unpack(f.recv, cand)
        for rows in updates:
            sampler.incoming(rows)
        if t.reduce is not None:
            lay.average(t.reduce, payloads)
        run._requests, run.sizes, run._inflow = (
            meta[:, 1].copy(),
            meta[:, -2].copy(),
            meta[:, 0].copy(),
        )
        run.ingested += sum(run._inflow.tolist())  # small: Python beats numpy's call cost
        t1 = time.perf_counter()
        if f.early:
            stats.mark("ingest", t_wait, t1)  # the span the fetch waited; ms: set-up + wait
            stats.ingest_ms = (f.launched - t0 + t1 - t_wait) * 1e3
        else:
            stats.mark("ingest", t0, t1)
        rb, n_in = run.spec.record_bytes, t.count + t.direct
        stats.items_in, stats.bytes_in = n_in, n_in * rb
        sampler_meta = meta[:, _META:-2]
        alloc = sampler.allocate(run.admit(run._requests, stats), run.sizes, r, sampler_meta)
        run.count_samples(alloc)
        self.alloc = alloc
        shares = sampler.shares(run.sizes, sampler_meta)
        self.cand = candidates(run._requests, shares, self.learners)
        if short(alloc, cand):  # the same on every rank: all run the ordinary delivery
            out = run._deliver(alloc, r, stats, t1)
        else:
            self.rounds += 1
            out = run.outputs.acquire(int(alloc[me].sum()))
            at = 0
            for p in lay.peers:
                k = int(alloc[me, p])
                if k:
                    out[at : at + k].copy_(blocks[p][:k])
                at += k
            own = int(alloc[me, me])
            if own:
                size = int(run.shard.size)
                run._gather(sampler.draw(own, size, r, stream=1), out[at:])
                stats.sent[me] += own * run.wire_bytes  # start() set it: a local copy
            t2 = time.perf_counter()
            stats.mark("sample", t1, t2)
            stats.mark("deliver", t2, t2)  # the rows arrived with the headers
            stats.items_out, stats.bytes_out = out.shape[0], out.shape[0] * run.wire_bytes
        t3 = time.perf_counter()
        weights.exchange(run.exchange, meta, run.weights_src, r, t.weights)
        stats.mark("weights", t3, time.perf_counter())
        sampler.feedback(r)
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The next round's candidate sizes and the last allocation."""
        alloc = self.alloc if self.alloc is not None else np.zeros((0, 0), dtype=np.int64)
        return {"cand": torch.from_numpy(self.cand.copy()), "alloc": torch.from_numpy(alloc.copy())}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict`."""
        self.cand = state["cand"].numpy().astype(np.int64).copy()
        alloc = state["alloc"].numpy().astype(np.int64)
        self.alloc = alloc.copy() if alloc.size else None
