"""The header exchange's wire layout: headers, payloads, candidates and update rows in one
all-to-all (``rounds/headers.py``).

Each rank sends each peer one block of record rows::

    [header rows][payload rows][candidate rows][update rows]

- header: this rank's meta row (``rounds/meta.py``), int64 packed into
  ``ceil(8 * width / record_bytes)`` rows;
- payload: a learner's ``reduce`` tensor (float32 bytes), sent from every learner to every other
  learner in every round, so the splits never depend on this round's values (the header's
  ``PAYLOAD`` column says whether one follows);
- candidates (speculative samplers): rows drawn i.i.d. from this shard for the peer (0 for
  actors), as many as ``candidates()`` sizes from the previous round: the peer's request times
  this shard's share of the draws then, plus a margin of 6 standard deviations of that binomial
  share (a round whose share exceeds it, e.g. the first or after a jump in a shard's share,
  delivers with the exact exchange instead, which every rank sees from the headers);
- updates (samplers that route feedback, e.g. priority updates): from a learner to a shard, room
  for as many ``(generation, value)`` pairs as the learner drew from that shard in the previous
  round, after a count (int64 pairs packed into rows; 0 rows when there is no room).

Every split depends only on values every rank already holds (the previous round's requests,
shares and allocation, the learner set, ``reduce_numel``), so all ranks agree on them without
exchanging them first.
"""

from __future__ import annotations

import ctypes
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch.autograd.graph import increment_version

from conduit_dist.errors import ConfigError
from conduit_dist.records.buffers import Pooled, RecordBuffer, keep, lasting_empty
from conduit_dist.records.native import _native
from conduit_dist.rounds.meta import PAYLOAD
from conduit_dist.rounds.tickets import RoundStats, RoundTicket


class WireLayout:
    """Buffers and splits of the header exchange on one rank.

    Args:
        record_bytes: bytes per record row.
        rank: this rank.
        learners: ``bool [world]``, which ranks are learners.
        head_len: int64 values in a header.
        reduce_numel: float32 elements of a payload (0: none).
        device: where the rows live (the host: headers are parsed there).
        lend: ``lend(rows, width)``: send rows the exchange lends (``Exchange.send_rows``:
            written where they go, not copied there), or ``None``; asked for host rows only.
    """

    def __init__(
        self,
        record_bytes: int,
        rank: int,
        learners: np.ndarray,
        head_len: int,
        reduce_numel: int,
        device: torch.device,
        lend=None,
    ) -> None:
        self.rb, self.rank, self.world = record_bytes, rank, learners.shape[0]
        # host rows over shared memory: the send rows are written in the exchange's own file
        self.lend = lend if torch.device(device).type == "cpu" else None
        self.learners = learners
        self._meta = torch.zeros((self.world, head_len), dtype=torch.int64)  # reused per round
        self._meta_np = self._meta.numpy()
        self.head = self._meta[rank]  # this rank's header is its row of the round's meta
        self._head_span = (self.head.data_ptr(), head_len * 8)  # its address and bytes
        # the extension's copies and mean where it is built (and new enough), else torch's
        self._copy_spans = getattr(_native, "copy_spans", None) or _memmove_spans
        self._mean2 = getattr(_native, "mean2_f32", None)
        self.h = -(-head_len * 8 // record_bytes)  # header rows
        self.numel = reduce_numel
        self.pay = -(-reduce_numel * 4 // record_bytes)  # payload rows between two learners
        self.peers = [p for p in range(self.world) if p != rank]
        self._send = RecordBuffer(record_bytes, device)
        # pooled receive buffers: a learner's batch may be a view of one (HeaderExchange's
        # one_block), so a buffer is written again only once nobody holds a tensor on it
        self._recv = _RecvPool(record_bytes, device)
        self.landed: np.ndarray | None = None  # the last receive buffer, as numpy (host rows)
        self._np: dict[int, tuple[torch.Tensor, np.ndarray]] = {}  # numpy views of the buffers
        self._rows = torch.empty((self.world, reduce_numel), dtype=torch.float32)
        # 1 / learners, as tensors: a Python scalar in an in-place op is a new tensor each call
        self._inv = [
            torch.tensor(1.0 / max(k, 1), dtype=torch.float32) for k in range(self.world + 1)
        ]
        self._splits: dict[bytes, tuple[list[int], list[int], list[int]]] = {}
        self.up_send = [0] * self.world  # update rows to each peer this round
        self.up_recv = [0] * self.world  # update rows from each peer this round

    def update_rows(self, pairs: int) -> int:
        """Rows holding a count and ``pairs`` int64 pairs (0 when there is no room)."""
        return -(-16 * (pairs + 1) // self.rb) if pairs > 0 else 0

    def set_updates(self, alloc: np.ndarray | None) -> dict[int, int]:
        """Size this round's update regions from last round's ``[learner, shard]`` allocation
        (``None``: no updates); returns the pairs this rank may send each peer."""
        me = self.rank
        if alloc is None:
            self.up_send = self.up_recv = [0] * self.world
            return {}
        send, recv = alloc[me].tolist(), alloc[:, me].tolist()
        send[me] = recv[me] = 0
        self.up_send = [self.update_rows(k) for k in send]
        self.up_recv = [self.update_rows(k) for k in recv]
        return {p: k for p, k in enumerate(send) if k}

    def splits(self, cand: np.ndarray) -> tuple[list[int], list[int], list[int]]:
        """``(payload rows, rows sent, rows received)`` per peer for the candidate counts
        ``cand[shard, learner]``."""
        me = self.rank
        out_c, in_c = cand[me], cand[:, me]
        key = out_c.tobytes() + in_c.tobytes()
        got = self._splits.get(key)
        if got is None:
            h = self.h
            pay = [
                self.pay if self.learners[me] and self.learners[p] and p != me else 0
                for p in range(self.world)
            ]
            send = [0 if p == me else h + pay[p] + int(out_c[p]) for p in range(self.world)]
            recv = [0 if p == me else h + pay[p] + int(in_c[p]) for p in range(self.world)]
            got = self._splits[key] = (pay, send, recv)
            if len(self._splits) > 64:  # requests that keep changing: keep the cache small
                self._splits = {key: got}
        if any(self.up_send) or any(self.up_recv):
            pay, send, recv = got
            send = [a + b for a, b in zip(send, self.up_send)]
            recv = [a + b for a, b in zip(recv, self.up_recv)]
            return pay, send, recv
        return got

    def _numpy(self, buf: RecordBuffer) -> np.ndarray:
        """A numpy view of ``buf``'s rows (slicing numpy costs ~1 us where torch costs ~10)."""
        got = self._np.get(id(buf))
        if got is None or got[0] is not buf.data:
            got = self._np[id(buf)] = (buf.data, buf.data.numpy())
        return got[1]

    def pack(
        self,
        cand: np.ndarray,
        payload: torch.Tensor | None,
        gather,
        slots: torch.Tensor | None,
        updates: dict[int, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        """The send rows: per peer the header, the payload, then ``cand[rank, peer]`` candidates
        gathered by ``gather(slots, out)`` from consecutive segments of ``slots``, then the
        update region (``updates[peer]``: ``[k, 2]`` int64 pairs, ``k`` within its room).

        Returns:
            ``(rows, in_splits)``.
        """
        pay, in_splits, _ = self.splits(cand)
        lent = self.lend(sum(in_splits), self.rb) if self.lend is not None else None
        if lent is not None:
            send, rows = lent
        else:
            send, rows = self._send.rows(sum(in_splits)), self._numpy(self._send)
        # header and payload copies: one native call (torch's slicing and copy_: ~5 us each);
        # both fit their rows (h and pay rows are sized from them), inside send's rows
        head, rb = self._head_span, self.rb
        base = send.data_ptr()
        spans: list[int] = []
        at = drawn = 0
        for p in self.peers:
            spans += (base + at * rb, *head)  # h rows: small records
            at += self.h
            if pay[p] and payload is not None:
                spans += (base + at * rb, payload.data_ptr(), self.numel * 4)
            at += pay[p]
            k = int(cand[self.rank, p])
            if k and slots is not None:
                gather(slots[drawn : drawn + k], send[at : at + k])
            at, drawn = at + k, drawn + k
            u = self.up_send[p]
            if u:
                region = rows[at : at + u].reshape(-1).view(np.int64)
                pairs = updates.get(p) if updates else None
                n = 0 if pairs is None else pairs.shape[0]
                region[0] = n
                if n:
                    region[2 : 2 + 2 * n] = pairs.numpy().reshape(-1)
                at += u
        if spans:
            self._copy_spans(tuple(spans))
        return send, in_splits

    def recv_rows(self, cand: np.ndarray) -> tuple[torch.Tensor, list[int]]:
        """The receive rows (the first rows of a pooled buffer nobody else holds) and their
        splits; :attr:`landed` is the buffer's numpy view until the next call."""
        _, _, out_splits = self.splits(cand)
        n = sum(out_splits)
        buf, self.landed = self._recv.acquire(n)
        return buf[:n], out_splits

    def unpack(
        self, recv: torch.Tensor, cand: np.ndarray
    ) -> tuple[np.ndarray, dict[int, int], dict[int, int], list[torch.Tensor]]:
        """Every rank's header (this rank's own included), where each peer's payload starts
        (learners that sent one) and where its candidate block starts in ``recv``, and the
        update pairs peers sent.

        Returns:
            ``(meta [world, head_len], payloads, candidates, updates)``; ``meta`` is reused by
            the next round; ``payloads`` and ``candidates``: ``{peer: first row}``;
            ``updates``: ``[k, 2]`` int64 views of ``recv`` (read them before it is reused).
        """
        pay, _, out_splits = self.splits(cand)
        meta, rows = self._meta_np, self.landed
        mb = meta.view(np.uint8)
        nb = mb.shape[1]
        payloads: dict[int, int] = {}
        blocks: dict[int, int] = {}
        updates: list[torch.Tensor] = []
        at = 0
        for p in range(self.world):
            if p == self.rank:
                continue
            mb[p] = rows[at : at + self.h].reshape(-1)[:nb]
            if pay[p] and meta[p, PAYLOAD]:
                payloads[p] = at + self.h
            u = self.up_recv[p]
            end = at + out_splits[p] - u
            blocks[p] = at + self.h + pay[p]
            if u:
                region = rows[end : end + u].reshape(-1).view(np.int64)
                n = int(region[0])
                if n:
                    # a view of the received rows: the queue copies it (``incoming``)
                    updates.append(torch.from_numpy(region[2 : 2 + 2 * n].reshape(n, 2)))
            at += out_splits[p]
        return meta, payloads, blocks, updates

    def _as_floats(self, recv: torch.Tensor, row: int, p: int) -> torch.Tensor:
        """Peer ``p``'s payload from ``recv[row:]``, as float32 values: a view of the rows when
        aligned, else a copy."""
        raw = recv[row:].reshape(-1)[: self.numel * 4]
        if (raw.storage_offset() % 4) == 0:
            return raw.view(torch.float32)
        self._rows[p].view(torch.uint8).copy_(raw)
        return self._rows[p]

    def average(self, payload: torch.Tensor, recv: torch.Tensor, payloads: dict[int, int]) -> None:
        """Replace ``payload`` by the mean of it and the payloads received, in place.

        Every rank adds the same values in rank order (two: IEEE addition commutes), so the
        result is bitwise identical on every learner: replicas updated with it stay identical.

        Args:
            payload: this learner's payload (a contiguous host float32 tensor: ``check_payload``).
            recv: the rows received (on the host: a plane with a payload keeps its rows there).
            payloads: ``{peer: first row}`` of each payload received (:meth:`unpack`).
        """
        if not payloads:
            return
        check_payload(payload, self.numel)  # again: changed while its round was in flight?
        if len(payloads) == 1:  # two learners: (a + b) * 0.5 in one pass, read where it landed
            ((p, row),) = payloads.items()
            if self._mean2 is None:
                payload.add_(self._as_floats(recv, row, p)).mul_(self._inv[2])
                return
            self._mean2(payload.data_ptr(), recv.data_ptr() + row * self.rb, self.numel)
            increment_version(payload)  # written by address: autograd's in-place check sees it
            return
        # the contributions in rank order in the first rows of the pooled [world, numel] buffer
        # (row i <= rank p: a payload copied into its own row is read before it is overwritten)
        rows = sorted([*payloads, self.rank])
        for i, p in enumerate(rows):
            src = payload if p == self.rank else self._as_floats(recv, payloads[p], p)
            if src.data_ptr() != self._rows[i].data_ptr():
                self._rows[i].copy_(src)
        torch.sum(self._rows[: len(rows)], dim=0, out=payload).mul_(self._inv[len(rows)])


def _memmove_spans(spans: tuple[int, ...]) -> None:
    """``copy_spans`` without the extension: each ``(dst, src, n)`` triple by ``ctypes``."""
    for i in range(0, len(spans), 3):
        ctypes.memmove(spans[i], spans[i + 1], spans[i + 2])


class _RecvPool:
    """Receive buffers of the header exchange, each with its numpy view, handed out again only
    once no tensor on one is held (:class:`Pooled`, as the output pool's); sized with an eighth
    of headroom, so rounds whose candidate counts wobble reuse them. Without use counts every
    round gets a new buffer (correct, slower)."""

    def __init__(self, record_bytes: int, device: torch.device, size: int = 3) -> None:
        self.rb, self.device, self.size = record_bytes, device, size
        self._pool: list[Pooled] = []

    def acquire(self, rows: int) -> tuple[torch.Tensor, np.ndarray]:
        """A buffer of at least ``rows`` rows nobody else references, and its numpy view."""
        for e in self._pool:
            if e.buf.shape[0] >= rows and e.free():
                return e.buf, e.array
        buf = lasting_empty((rows + rows // 8 + 16, self.rb), dtype=torch.uint8, device=self.device)
        entry = Pooled(buf, buf.numpy())
        if entry.idle is not None:
            keep(self._pool, entry, self.size)
        return buf, entry.array

    def buffers(self) -> list[torch.Tensor]:
        """The pooled buffers."""
        return [e.buf for e in self._pool]


@dataclass
class Flight:
    """A header exchange between its launch and its landing."""

    ticket: RoundTicket
    stats: RoundStats
    t0: float
    cand: np.ndarray  # [shard, learner] candidate rows of this round
    recv: torch.Tensor
    work: object  # the exchange's pending all-to-all (``.wait()``)
    launched: float = 0.0  # perf_counter when the exchange was launched
    early: bool = False  # started by fetch_start: the caller's work runs before the finish
    blocks: dict[int, int] | None = None  # where each peer's candidate rows start, once landed
    seen_in_flight: float = 0.0  # early: the latest perf_counter it was seen still running

    def poll(self) -> None:
        """Note the time if the exchange is still running (an early-started round: the span
        from its launch to the latest such time certainly overlapped the caller's work)."""
        if self.work.in_flight():
            self.seen_in_flight = time.perf_counter()


def short(alloc: np.ndarray, cand: np.ndarray) -> bool:
    """Whether some learner's share from another shard exceeds the candidates it was sent
    (``alloc[learner, shard] > cand[shard, learner]``; a learner reads its own shard locally)."""
    world = alloc.shape[0]
    if world > 16:
        over = alloc > cand.T
        np.fill_diagonal(over, False)
        return bool(over.any())
    rows, sent = alloc.tolist(), cand.T.tolist()  # a few values: Python beats numpy's calls
    return any(n > sent[i][s] for i, row in enumerate(rows) for s, n in enumerate(row) if s != i)


def candidates(requests: np.ndarray, shares: np.ndarray, learners: np.ndarray) -> np.ndarray:
    """``int64 [shard, learner]`` candidate rows for the next round: each learner's request
    times each shard's share, plus 6 standard deviations of the binomial share, 1% and 4 rows
    (capped at the request; 0 to itself and to actors).

    Args:
        requests: ``[world]`` this round's fetch sizes.
        shares: ``[world]`` each shard's probability of a draw this round (sums to 1, or all 0).
        learners: ``bool [world]``.
    """
    world = requests.shape[0]
    if world <= 8:  # a few values: Python beats numpy's per-call cost (~2 us against ~19)
        req_l, p_l, learn = requests.tolist(), shares.tolist(), learners.tolist()
        out = np.zeros((world, world), dtype=np.int64)
        for s, p_s in enumerate(p_l):
            if p_s <= 0:
                continue
            for lr, (r, is_l) in enumerate(zip(req_l, learn)):
                if lr == s or not is_l or r <= 0:
                    continue
                mean = r * p_s
                want = math.ceil(mean + 6.0 * math.sqrt(mean * (1.0 - p_s)) + 0.01 * r + 4.0)
                out[s, lr] = min(want, r)
        return out
    req = np.where(learners, requests, 0).astype(np.float64)[None, :]
    p = shares.astype(np.float64)[:, None]
    mean = req * p
    want = np.ceil(mean + 6.0 * np.sqrt(mean * (1.0 - p)) + 0.01 * req + 4.0)
    cand = np.minimum(want, req).astype(np.int64)
    cand[p[:, 0] <= 0, :] = 0
    np.fill_diagonal(cand, 0)
    return cand


def check_payload(t: torch.Tensor, numel: int, device: torch.device | None = None) -> None:
    """Check a fetch's ``reduce`` payload.

    Args:
        t: the payload.
        numel: float32 elements the plane was built for.
        device: where it must be (``None``: host memory, the headers' payload; a device
            plane's payload is all-reduced on the plane's device).

    Raises:
        ConfigError: unless it is a contiguous, 4-byte aligned float32 ``[numel]`` tensor on
            ``device`` that does not require grad and is no inference tensor (or when the
            plane has no payloads: ``numel == 0``).
    """
    if numel == 0:
        raise ConfigError("reduce: this plane was built with reduce_numel=0; pass reduce_numel")
    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"reduce: expected a torch.Tensor, got {type(t).__name__}")
    # is_cpu and shape[0]: no device or size object built (every round checks its payload)
    where = t.is_cpu if device is None else t.device == device
    ok = where and t.dtype == torch.float32 and t.dim() == 1 and t.shape[0] == numel
    if not ok or not t.is_contiguous():
        want = "cpu" if device is None else str(device)
        raise ConfigError(
            f"reduce: expected a contiguous {want} float32 tensor of shape ({numel},), got "
            f"{t.dtype} {tuple(t.shape)} on {t.device}, contiguous={t.is_contiguous()}"
        )
    if t.requires_grad:  # averaged in place: autograd forbids it on a tensor that needs grad
        raise ConfigError(
            "reduce: expected a tensor that does not require grad (it is averaged in place), got "
            "requires_grad=True; pass a gradient buffer or t.detach()"
        )
    if t.is_inference():  # written in place by address: autograd could not refuse it later
        raise ConfigError(
            "reduce: expected a tensor created outside torch.inference_mode() (it is averaged in "
            "place), got an inference tensor; pass a gradient buffer or t.clone() outside it"
        )
    if t.data_ptr() % 4:
        raise ConfigError(
            f"reduce: expected float32 data aligned to 4 bytes, got address {t.data_ptr():#x}"
        )
