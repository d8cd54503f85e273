"""Ingestion: a round's staged items into their owner shards.

Items that stay where they were put (the fused and world-size-1 schedules) are committed (written
ahead into the shard by ``put``) or appended locally. Otherwise the placement's plan
``send[src, dst]`` (replicated from the meta) moves the staged rows in one exchange whose
strategy the bandwidth model picks; the receiving shard receives straight into its slots when
they do not wrap. Samplers whose windows need a stream's items on one shard (``Streams``) have
each staged item routed by its stream key (``Placement.route``, a stable function), and the
per-destination counts travel in the meta so every rank holds the whole plan.
"""

from __future__ import annotations

import numpy as np
import torch

from conduit_dist.records.buffers import RecordBuffer
from conduit_dist.rounds.tickets import RoundStats, RoundTicket
from conduit_dist.syncs import SYNCS
from conduit_dist.tiers.cuda import upload


class Ingest:
    """Moves a rank's staged records into the store.

    Args:
        storage: this rank's shard.
        exchange: the plane's collectives (rank, world).
        transport: runs an exchange with the strategy the bandwidth model picks.
        record_bytes: bytes of a stored record.
        device: the round's rows device (staged records are copied there first; the exchange
            runs there, received straight into the shard's slots only when they are on it).
        reads: ``reads(first, rows)``: told every block of records the shard takes in, with
            the generation of its first (a device-rows plane's sampler keeps a host copy of the
            columns its bookkeeping reads: ``ReadsColumns``); host staging is given as it is,
            so those rows never come back from the device. ``None``: nobody reads them.
    """

    def __init__(self, storage, exchange, transport, record_bytes: int, device, reads=None) -> None:
        self.storage, self.transport, self.reads = storage, transport, reads
        self.rank, self.world = exchange.rank, exchange.world
        self.rb, self.device = record_bytes, device
        self._recv = RecordBuffer(record_bytes, device)
        self._dev_stage = RecordBuffer(record_bytes, device)  # H2D copy of staged records
        self._routed = RecordBuffer(record_bytes, device)  # staged rows in destination order
        self._order: torch.Tensor | None = None  # this round's destination order (routed)
        self._into_storage = storage.tiers[0].data.device == device

    def staged_rows(self, t: RoundTicket) -> torch.Tensor:
        """This round's staged records on the rows device, as one block of rows.

        Host staging (pinned on CUDA machines) is used where it is for host rows, or copied to
        the GPU on the round's stream; device staging (items put from GPU tensors) likewise,
        copied to the host for host rows. Device staging first: it holds only puts made before
        any host put of the round (``Stager._stage_for``), so rows keep their put order.
        """
        host, dev = t.staged, t.device_staged
        if dev is None or not dev.count:
            inp = host.view()
            if inp.device == self.device:
                return inp
            return self._dev_stage.rows(host.count).copy_(inp, non_blocking=True)
        if not host.count and dev.view().device == self.device:
            return dev.view()
        rows = self._dev_stage.rows(dev.count + host.count)
        rows[: dev.count].copy_(dev.view())
        rows[dev.count :].copy_(host.view(), non_blocking=True)
        return rows

    def local(self, t: RoundTicket) -> int:
        """Commit what ``put`` wrote ahead into the shard, append the staged rows; returns the
        items this shard took in."""
        if t.direct:
            self.storage.commit(t.direct)
        if t.count:
            first = self.storage.written
            self.storage.append(self.staged_rows(t))
            if self.reads is not None:
                self._read_staged(t, first)
        return t.count + t.direct

    def _read_staged(self, t: RoundTicket, first: int) -> None:
        """Tell ``reads`` the staged records just appended from ``first`` (device staging
        first, then host staging, as :meth:`staged_rows` orders them), from where they were
        staged."""
        dev = t.device_staged
        n_dev = dev.count if dev is not None else 0
        if n_dev:
            self.reads(first, dev.view())
        if t.staged.count:
            self.reads(first + n_dev, t.staged.view())

    def route(self, t: RoundTicket, keys_of, route) -> np.ndarray:
        """Order this round's staged rows by destination (stable: a stream's items keep their
        order) and return the items to each shard (``[world]``, the meta's routed columns).

        Args:
            keys_of: ``records -> int64 [n]`` stream keys (``Streams.stream_keys``).
            route: ``(src, keys) -> [n]`` destination shards (``Placement.route``).
        """
        if not t.count:
            self._order = None
            return np.zeros(self.world, dtype=np.int64)
        # keys read where the records were staged (host staging: no copy back from the device)
        dev, parts = t.device_staged, []
        if dev is not None and dev.count:  # items put from CUDA tensors: their keys come up
            parts.append(keys_of(dev.view()).cpu())
            SYNCS.add("stream keys of device puts")
        if t.staged.count:
            parts.append(keys_of(t.staged.view()))
        keys = torch.cat(parts) if len(parts) > 1 else parts[0]
        dest = np.asarray(route(self.rank, keys.numpy()), dtype=np.int64)
        self._order = torch.from_numpy(np.argsort(dest, kind="stable"))
        return np.bincount(dest, minlength=self.world).astype(np.int64)

    def exchange(self, t: RoundTicket, plan: np.ndarray, stats: RoundStats) -> int:
        """Move the staged rows to their owners by ``plan[src, dst]`` (replicated: every rank
        runs the exchange or none does); returns the items this shard took in."""
        me = self.rank
        n_in = int(plan[:, me].sum())
        if not plan.any():
            return 0
        stats.add_sent(plan[me] * self.rb)  # own row: kept locally
        inp = self.staged_rows(t)
        if self._order is not None:
            out = self._routed.rows(inp.shape[0])
            torch.index_select(inp, 0, upload(self._order, inp.device), out=out)
            inp, self._order = out, None
        between = plan.copy()
        np.fill_diagonal(between, 0)
        first = self.storage.written
        if not between.any():
            self.storage.append(inp)  # every item stays put (known on every rank): no exchange
            if self.reads is not None:  # in put order (all routed here): read where staged
                self._read_staged(t, first)
            return n_in
        # received straight into the shard's slots only where they are on the rows device
        direct = self.storage.receive(n_in) if self._into_storage else None
        out = direct if direct is not None else self._recv.rows(n_in)
        stats.moves.append(self.transport.move(out, inp, plan, t.round, "ingest"))
        if direct is not None:
            self.storage.commit(n_in)
        else:
            self.storage.append(out)
        if self.reads is not None:  # rows from peers exist only here: their columns come up
            self.reads(first, out)  # (on device rows, read in this round: one host sync)
        return n_in
