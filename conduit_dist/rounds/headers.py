"""The header exchange: every rank's meta row, learners' payloads, candidate rows and update rows
in one ``all_to_all_single`` (wire layout in ``wire.py``).

It is the whole round's exchange on the fused schedule (items stay where they were put, so the
headers carry the round's counts), and the general schedule's second exchange, after ingestion,
when the sampler reports values of its shard (priority masses), routes feedback, or a payload
rides. Candidates are sent only for speculative samplers: each shard sends each learner i.i.d.
draws before the allocation is known (sized from the previous round), and a learner takes a
prefix of each block once the allocation, computed from the headers on every rank alike, says
how many (a prefix of i.i.d. draws is i.i.d.). When some learner's share exceeds what it was
sent, every rank sees it, and the round delivers with the exact exchange instead.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from conduit_dist.rounds.tickets import RoundStats, RoundTicket
from conduit_dist.rounds.wire import Flight, WireLayout, candidates, short
from conduit_dist.sampling.base import RoutesFeedback, Speculative


class HeaderExchange:
    """One plane's header exchanges, and what they size themselves from (replicated).

    Args:
        exchange: the plane's collectives.
        sampler: the plane's sampler (its draws, shares and feedback).
        write: ``write(generations, out)``: a shard's delivered rows (the sampler's or the
            storage's gather).
        learners: ``bool [world]`` which ranks fetch.
        head_len: int64 values in a header (``MetaLayout.width``).
        wire_bytes: bytes of a delivered row.
        reduce_numel: float32 elements of a payload riding the headers (0: none).
        device: where the headers live (the host: they are parsed there).
        candidates: send speculative candidates (host rows only: a device-rows plane's
            headers carry no rows; its learners get theirs in the exact delivery exchange).
    """

    def __init__(
        self,
        exchange,
        sampler,
        write,
        learners: np.ndarray,
        head_len: int,
        wire_bytes: int,
        reduce_numel: int,
        device: torch.device,
        candidates: bool = True,
    ) -> None:
        self.ex, self.sampler, self.write, self.learners = exchange, sampler, write, learners
        self.rank, world = exchange.rank, exchange.world
        self.layout = WireLayout(
            wire_bytes,
            self.rank,
            learners,
            head_len,
            reduce_numel,
            device,
            exchange.send_rows,
        )
        self.speculative = candidates and isinstance(sampler, Speculative)
        self.routes = isinstance(sampler, RoutesFeedback)
        # candidate rows [shard, learner] of the next round (sized from this one's)
        self.cand = np.zeros((world, world), dtype=np.int64)
        self.alloc: np.ndarray | None = None  # last round's allocation (update rows' room)
        self.head = self.layout.head.numpy()  # this rank's header (written before launch)

    def launch(self, t: RoundTicket, stats: RoundStats, t0: float) -> Flight:
        """Draw this round's candidates (after the round's items are in), pack header, payload,
        candidates and update rows, and launch the all-to-all; returns it in flight."""
        lay, me, sampler = self.layout, self.rank, self.sampler
        cand = self.cand
        # the own-shard share is drawn once known (take); a few values: Python's sum
        n_cand = sum(cand[me].tolist()) if cand.shape[0] <= 64 else int(cand[me].sum())
        gens = None
        if n_cand and sampler.storage.size and sampler.drawable():  # else nothing reads them
            gens = sampler.draw(n_cand, t.round)
        budgets = lay.set_updates(self.alloc if self.routes else None)
        updates = sampler.outgoing(budgets) if budgets else None
        send, in_splits = lay.pack(cand, t.reduce, self.write, gens, updates)
        recv, out_splits = lay.recv_rows(cand)
        stats.add_sent(np.asarray(in_splits, dtype=np.int64) * lay.rb)
        work = self.ex.all_to_all_async(
            recv, send, out_splits, in_splits, t.round, "all_to_all(round)"
        )
        return Flight(t, stats, t0, cand, recv, work, time.perf_counter())

    def land(self, f: Flight) -> np.ndarray:
        """Wait for the exchange; returns every rank's header (``[world, head_len]``, reused
        next round). Updates peers sent go to the sampler; the payload is averaged in place."""
        f.work.wait()
        meta, payloads, f.blocks, updates = self.layout.unpack(f.recv, f.cand)
        for rows in updates:
            self.sampler.incoming(rows)
        if f.ticket.reduce is not None:
            self.layout.average(f.ticket.reduce, f.recv, payloads)
        return meta

    def allocated(self, counts: np.ndarray, requests: np.ndarray, shares: np.ndarray) -> None:
        """Size the next round's candidates and update rows from this round's allocation."""
        self.alloc = counts
        if self.speculative:
            self.cand = candidates(requests, shares, self.learners)

    def covers(self, f: Flight, counts: np.ndarray) -> bool:
        """Whether every learner's share from every other shard is within what it was sent
        (the same on every rank)."""
        return self.speculative and not short(counts, f.cand)

    def one_block(self, f: Flight, counts: np.ndarray) -> torch.Tensor | None:
        """This learner's whole share as a view of the received rows, where it all comes from
        one peer's candidates (none from its own shard: a remote learner); else ``None``. The
        receive buffer is pooled by use count: no round writes it while the view is held."""
        row = counts[self.rank].tolist()
        if row[self.rank]:
            return None
        block = None
        for p in self.layout.peers:
            if row[p]:
                if block is not None:
                    return None
                block = (f.blocks[p], row[p])
        return None if block is None else f.recv[block[0] : block[0] + block[1]]

    def take(self, f: Flight, counts: np.ndarray, out: torch.Tensor) -> int:
        """Copy this learner's share of each peer's candidates into ``out`` (peers in rank
        order); returns the rows filled."""
        at, row = 0, counts[self.rank].tolist()
        host = out.is_cpu  # numpy slices cost ~1 us where torch's cost ~5
        dst, src = (out.numpy(), self.layout.landed) if host else (out, f.recv)
        for p in self.layout.peers:
            k = row[p]
            if k:
                start = f.blocks[p]
                dst[at : at + k] = src[start : start + k]
            at += k
        return at

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The next round's candidate sizes and the last allocation."""
        alloc = self.alloc if self.alloc is not None else np.zeros((0, 0), dtype=np.int64)
        return {"cand": torch.from_numpy(self.cand.copy()), "alloc": torch.from_numpy(alloc.copy())}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict`."""
        self.cand = state["cand"].numpy().astype(np.int64).copy()
        alloc = state["alloc"].numpy().astype(np.int64)
        self.alloc = alloc.copy() if alloc.size else None

    def reset(self) -> None:
        """Forget the sizes (after a restore: the next round sizes its candidates afresh)."""
        self.cand = np.zeros_like(self.cand)
        self.alloc = None
