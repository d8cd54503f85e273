"""Delivery: a shard's share of every learner's batch, gathered and moved to the learners.

Every learner's rows land in a pooled output buffer (``records.buffers.OutputPool``), grouped
by shard: other shards' rows first (in rank order), its own shard's last. A learner's rows from
its own shard are written straight into its output and never enter an exchange; when no
learner reads another rank's shard, no collective runs. Rows are written by the sampler when it
composes them (``WritesRows``: trailers, windows), else gathered from the storage.

Rows are composed and exchanged on the round's *rows device* (``rounds.engine.round_devices``):
the learner's device where everything the round touches is there, else the host. Rows composed
on the host for a CUDA learner then *land* (:class:`Landing`): composed in pinned buffers reused
across rounds, copied without blocking on the round's stream (the scheduler's side stream),
whose event the consumer's stream waits on before it reads the batch; a pinned buffer is
written again only after the copy that read it has finished, a device buffer only after the
consumer's stream has passed its last batch (``OutputPool``). The same stage serves every
sampler.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from conduit_dist.records.buffers import OutputPool, RecordBuffer
from conduit_dist.rounds.tickets import RoundStats


class Delivery:
    """This rank's side of every round's delivery.

    Args:
        sampler: draws this shard's share.
        write: ``write(generations, out)``: the delivered rows of draws.
        exchange: the plane's collectives (rank, world).
        transport: runs the delivery exchange.
        wire_bytes: bytes of a delivered row.
        devices: ``(rows, learner)``: where rows are composed and exchanged, and where batches
            are delivered (the same, or the host and a GPU).
        unpack: records -> field views (the spec's ``unpack``), for the output pool.
    """

    def __init__(self, sampler, write, exchange, transport, wire_bytes, devices, unpack) -> None:
        self.sampler, self.write, self.transport = sampler, write, transport
        self.rank, self.world = exchange.rank, exchange.world
        self.wire = wire_bytes
        rows_device, device = devices
        self.landing = Landing(wire_bytes, rows_device, device, unpack)
        self.rows = self.landing.rows  # where a round's batch is composed
        self.outputs = self.landing.outputs  # what the learner gets (and unpacks)
        self._send = RecordBuffer(wire_bytes, rows_device)

    def exact(self, counts: np.ndarray, round: int, stats: RoundStats, t1: float) -> torch.Tensor:
        """Draw this shard's share of every learner's batch (``counts[learner, shard]``), write
        its own learner's rows into its output and deliver the rest in one exchange."""
        me = self.rank
        if self.world == 1:  # one shard: its draws are the batch
            n_recv = int(counts[0, 0])
            out = self.rows.acquire(n_recv)
            if n_recv:
                self.write(self.sampler.draw(n_recv, round), out)
            stats.mark("sample", t1, time.perf_counter())
            stats.items_out, stats.bytes_out = n_recv, n_recv * self.wire
            return out
        to_learners = counts[:, me]  # rows this shard gives each learner
        n_recv = int(counts[me].sum())
        out = self.rows.acquire(n_recv)
        mine = int(counts[me, me])
        first = int(to_learners[:me].sum())  # this learner's rows among this shard's draws
        n_draw = int(to_learners.sum())
        remote = n_recv - mine
        stats.add_sent(to_learners * self.wire)  # the own learner's rows: copied locally
        send = self._send.rows(n_draw - mine)
        if n_draw:
            gens = self.sampler.draw(n_draw, round)
            if mine:
                self.write(gens[first : first + mine], out[remote:])
            # the draws before and after this learner's, no concatenation
            if first:
                self.write(gens[:first], send[:first])
            if n_draw > first + mine:
                self.write(gens[first + mine :], send[first:])
        t2 = time.perf_counter()
        stats.mark("sample", t1, t2)
        rows = counts.T.copy()  # rows[shard, learner], own-shard rows already placed
        np.fill_diagonal(rows, 0)
        if rows.any():  # the same on every rank: all run the exchange or none does
            stats.moves.append(self.transport.move(out[:remote], send, rows, round, "deliver"))
        stats.mark("deliver", t2, time.perf_counter())
        stats.items_out, stats.bytes_out = n_recv, n_recv * self.wire
        return out

    def own(self, counts: np.ndarray, round: int, out: torch.Tensor, at: int) -> None:
        """Draw and write this learner's own-shard share after ``at`` rows of ``out`` (a
        second stream of the round: candidates already used the first)."""
        own = int(counts[self.rank, self.rank])
        if own:
            self.write(self.sampler.draw(own, round, stream=1), out[at : at + own])


class Landing:
    """Moves a round's batch from the device it was composed on to the learner's device.

    Where both are the same, :meth:`land` returns the rows as they are and ``rows`` is
    ``outputs``. Else rows are composed in a pinned host pool, and :meth:`land` copies them into
    a device buffer of ``outputs`` on the current stream (the round's side stream, inside the
    scheduler's ``torch.cuda.stream`` block; the consumer waits on the round's event), and marks
    the pinned buffer as read by that copy's event.

    Args:
        wire_bytes: bytes of a delivered row.
        rows_device: where rows are composed.
        device: where batches are delivered.
        unpack: records -> field views.
    """

    def __init__(self, wire_bytes: int, rows_device, device, unpack) -> None:
        self.outputs = OutputPool(wire_bytes, device, unpack)
        self.moves = rows_device != device
        if self.moves and not (rows_device.type == "cpu" and device.type == "cuda"):
            raise ValueError(
                f"delivery: rows composed on {rows_device} land on a GPU from the host only; "
                f"got a learner on {device}"
            )
        self.rows = (
            OutputPool(wire_bytes, rows_device, unpack, pin_memory=True)
            if self.moves
            else self.outputs
        )

    def land(self, rows: torch.Tensor) -> torch.Tensor:
        """The learner's batch on its device (``rows`` itself where nothing moves)."""
        if not self.moves:
            return rows
        out = self.outputs.acquire(rows.shape[0])  # waits for the consumer's last reads
        if rows.shape[0]:
            out.copy_(rows, non_blocking=True)  # pinned -> device, on the round's stream
            event = torch.cuda.current_stream(out.device).record_event()
            self.rows.read_by(rows, event)
        return out
