"""Versioned learner weights, packed into one self-describing byte buffer and sent in a round.

Learners holding the same weights each pack a part and send it, in buckets, to every receiver
(:meth:`WeightsState.exchange`): no rank sends the whole model, and a receiver loads a version
only once every part of it arrived (docs/weights.md).

A published buffer carries its own layout (``flow/weights_format.py``), so a receiver checks
names, shapes and dtypes against its module before it loads a byte (no pickle).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from conduit_dist.collectives.exchange import Exchange
from conduit_dist.errors import SpecError
from conduit_dist.flow.weight_files import InFiles, WeightFiles
from conduit_dist.flow.weights_format import (
    PREAMBLE,
    Layout,
    checked_state,
    decode,
    differences,
    entries_of,
    fill,
    fill_shards,
    head_digest,
    header_of,
    is_dtensor,
    local_rows,
    pack_part,
    shards_of,
)
from conduit_dist.records.buffers import Pooled, keep, lasting_empty, use_count
from conduit_dist.records.spec import ALIGN, align
from conduit_dist.syncs import SYNCS

# the default largest piece of a weights transfer: on 2 shared cores (bench weights, loopback)
# larger pieces only interleave less with the pack (nothing overlaps there); across a link the
# pack hides behind 64 MiB pieces (docs/benchmarks.md), which also bound NCCL's per-call size
BUCKET_BYTES = 64 << 20


@dataclass(frozen=True)
class WeightsSnapshot:
    """What the publisher had published when a round was prepared."""

    version: int
    buf: torch.Tensor | None
    head: int = 0  # a device buffer's header digest (WeightsState.head_digest); 0: none
    # a version published to be packed by the round that sends it (publish(lazy=True)):
    # pack(lo, hi) writes bytes [lo, hi) of it into ``buf`` from the module; None: packed
    pack: Callable[[int, int], None] | None = None
    slot: int = -1  # the publisher's weights file (shared memory, ``weight_files``); -1: none
    # a sharded state's buffer (FSDP2): the bytes of its header (and padding), which the
    # round sends first (receivers learn who sends what from it); 0: not sharded
    shard_head: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the whole buffer (header and payload)."""
        return 0 if self.buf is None else self.buf.numel()


def parts(nbytes: int, count: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` byte ranges splitting a buffer of ``nbytes`` among ``count`` senders: as
    equal as ``ALIGN``-byte boundaries allow (the last takes the rest), so each of ``count``
    learners holding the same weights sends about ``1/count`` of them.

    Example:
        >>> parts(100, 2)
        [(0, 48), (48, 100)]
    """
    if count < 1:
        raise ValueError(f"parts: expected count >= 1, got {count}")
    step = (nbytes // count) // ALIGN * ALIGN
    edges = [min(i * step, nbytes) for i in range(count)] + [nbytes]
    return [(edges[i], edges[i + 1]) for i in range(count)]


def buckets(lo: int, hi: int, size: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` in consecutive ranges of at most ``size`` bytes (none when empty)."""
    return [(a, min(a + size, hi)) for a in range(lo, hi, size)]


class _Buffers:
    """Weight buffers of one size reused once nobody holds them: not the current one, not a
    round's snapshot, not a ``pull`` in progress (storage use counts, as the output pool's), so
    a buffer is never written while anyone may read it. Without use counts, always a new one.

    On CUDA, "nobody holds it" is the host's view: a broadcast or a pull's copies may still run
    on the device. Each device use ends with :meth:`used` (an event on the stream that used it),
    and :meth:`take` makes the taker's stream wait for the buffer's last one (on the device).
    The pool is used from two threads (a publish, a round receiving): under its own lock."""

    def __init__(self, size: int = 3, device: torch.device | None = None) -> None:
        self._pool: list[Pooled] = []
        self.size = size
        self.device = device if device is not None else torch.device("cpu")
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A ``uint8 [nbytes]`` buffer nobody else references (contents undefined): a distinct
        tensor on a pooled storage, so that while it (the current buffer, a snapshot, a pull's
        reference) lives, the storage's use count says so."""
        with self._lock:
            for e in self._pool:
                if e.buf.shape[0] == nbytes and e.free():
                    if e.released is not None:  # its last device use, before the taker's writes
                        torch.cuda.current_stream(self.device).wait_event(e.released)
                    return e.buf.detach()
            buf = lasting_empty(nbytes, dtype=torch.uint8, device=self.device)
            if use_count(buf) is None:
                return buf
            keep(self._pool, Pooled(buf), self.size)  # a free one of an old size leaves first
            return buf.detach()

    def _entry(self, buf: torch.Tensor) -> Pooled | None:
        """The pooled buffer ``buf`` is a tensor on (``None``: not one of the pool's)."""
        ptr = buf.untyped_storage().data_ptr()
        with self._lock:
            return next((e for e in self._pool if e.buf.untyped_storage().data_ptr() == ptr), None)

    def wait(self, buf: torch.Tensor) -> None:
        """CUDA: make the current stream wait for ``buf``'s last recorded use (its pack, on
        the publisher's stream; a transfer, on the round's) before it reads it; nothing on the
        host."""
        if self.device.type != "cuda":
            return
        e = self._entry(buf)
        if e is not None and e.released is not None:
            torch.cuda.current_stream(self.device).wait_event(e.released)

    def used(self, buf: torch.Tensor) -> None:
        """CUDA: ``buf`` was used on the current stream up to here (a fill, a transfer, a
        pull's copies); the next :meth:`take` of its storage waits for that on the device."""
        if self.device.type != "cuda":
            return
        e = self._entry(buf)
        if e is not None:
            e.released = torch.cuda.current_stream(self.device).record_event()


@dataclass
class Transfer:
    """What this rank did in the last weights transfer (``WeightsState.last``).

    ``schedule`` is ``"p2p"`` (each owner sends its part to each receiver, bucket by bucket),
    ``"relay"`` (across hosts: each part over a host's link once, then passed on inside it),
    ``"broadcast"`` (each owner broadcasts its part to the group: CUDA buffers over gloo, which
    has no send/recv for them) or ``"shm"`` (one host: owners pack into ``/dev/shm`` files,
    receivers copy the parts out). ``sent``/``received`` count this rank's payload bytes (under
    ``"shm"``, ``sent`` is what it packed for the others); ``buckets`` the messages (or parts
    copied) it took part in."""

    version: int = 0
    schedule: str = ""
    owners: tuple[int, ...] = ()
    sent: int = 0
    received: int = 0
    buckets: int = 0
    seconds: float = 0.0


class WeightsState:
    """The publisher's packed weights, or the latest weights received, with their version.

    A new version goes into another buffer, never the current one: a buffer is written only when
    nobody holds it (:class:`_Buffers`), so a round running on another thread reads or hands
    over a complete buffer (or, for a lazy publish, packs each piece just before sending it
    while the caller waits), and a steady publisher or receiver allocates nothing. Each
    buffer describes its own layout (see the module docstring), checked on :meth:`pull`.

    Several learners holding the same weights (data parallel) each pack only their *part* of a
    version (``publish(module, part=(i, L))``: about ``1/L`` of the bytes) and a round's
    :meth:`exchange` has every owner send its part to every receiver, in buckets of
    ``bucket_bytes``: no rank sends the whole model. A version is loadable (:meth:`pull`,
    :meth:`whole`) only once every part of it is here: never torn.

    Args:
        device: where the buffers live (``None``: the host).
        bucket_bytes: the largest piece one send or receive moves (:data:`BUCKET_BYTES`).

    Example:
        >>> ws = WeightsState()
        >>> ws.publish(nn.Linear(2, 3))
        >>> ws.pull(nn.Linear(2, 3))
        1
    """

    def __init__(self, device: torch.device | None = None, bucket_bytes: int = 0) -> None:
        bucket_bytes = bucket_bytes or BUCKET_BYTES
        if bucket_bytes < ALIGN or bucket_bytes % ALIGN:
            raise SpecError(
                f"weights: bucket_bytes: expected a positive multiple of {ALIGN}, got "
                f"{bucket_bytes}"
            )
        self.bucket_bytes = bucket_bytes
        self.version = 0
        self.buf: torch.Tensor | None = None  # the newest buffer (an owner's: maybe a part)
        self.part = (0, 1)  # which part of ``buf`` this rank packed (index, count)
        # the newest complete buffer: (version, buffer, header digest) or None
        self._whole: tuple[int, torch.Tensor, int] | None = None
        self.broadcast = 0  # last version sent in a round (the same on every rank)
        self.last = Transfer()  # this rank's side of the last transfer
        # every transfer this rank took part in: count, seconds, payload bytes sent/received
        self.totals = {"transfers": 0, "seconds": 0.0, "sent": 0, "received": 0}
        self._decoded: tuple[int, int, Layout] | None = None  # (version, address, layout)
        # device buffers: every buffer on ``device`` (published from and loaded into modules
        # there, sent by the group's backend for CUDA tensors); a receiver reads a header
        # to the host only when its digest (carried in the round's meta) is new
        self.device = device
        self._buffers = _Buffers(device=device)
        # publish's last layout: (key, header, total bytes, entries, header digest or 0)
        self._head: tuple[tuple, bytes, int, dict, int] | None = None
        self.head = 0  # the current buffer's header digest (device buffers; 0: unknown)
        self._layouts: dict[int, Layout] = {}  # device buffers: decoded layouts by digest
        # a lazy publish not packed yet: (buffer, header, entries, state, lo, hi)
        self._pending: tuple | None = None
        # publish (the caller's thread) and a round's exchange (the plane's) both make
        # versions current: under this lock, and only ever forward
        self._lock = threading.Lock()
        # host weights through /dev/shm (a token plane's shared memory; set by its build):
        # a learner packs its part into a file of its own, receivers copy the parts out
        self.files: WeightFiles | None = None
        self.slot = -1  # the file the current buffer is (shared memory)
        self.shard_head = 0  # a sharded buffer's header bytes (WeightsSnapshot.shard_head)
        # read in place from other ranks' files (shared memory): the version this rank is
        # pulling (0: none), and its module views since its last in-place pull
        self._pulling = 0
        # modules loaded in place from files: (version, the mappings' pooled use counts)
        self._views: list[tuple[int, list[Pooled]]] = []
        self._read_lock = threading.Lock()  # reads of files: one at a time (_pulling)
        self._copy: tuple[int, torch.Tensor] | None = None  # whole()'s copy of InFiles
        self._shards_known: tuple[bytes, object] | None = None  # (header, its shards)
        # the plane's transport (its topology and bandwidth model price a relay; set by the
        # planes' builds); None: every part straight to every receiver
        self.transport = None

    def snapshot(self, lazy: bool = False) -> WeightsSnapshot:
        """The current version and buffer (taken when a round is prepared); without a buffer
        (restored, not published since) the last version broadcast: nothing new to send.

        Args:
            lazy: a lazy publish stays unpacked and the snapshot packs it as it is sent (only
                for a round run while the module cannot change); otherwise it is packed now.
        """
        if not lazy:
            self.settle()
        with self._lock:  # a round finishing on the plane's thread may be moving them
            if self.buf is None:
                return WeightsSnapshot(min(self.version, self.broadcast), None)
            pending = self._pending
            pack = None if pending is None else functools.partial(pack_part, pending)
            return WeightsSnapshot(
                self.version, self.buf, self.head, pack, self.slot, self.shard_head
            )

    def settle(self) -> None:
        """Pack what a lazy publish left unpacked (its round sent nothing), so the current
        buffer is whole before the module may change."""
        pending = self._pending
        if pending is None:
            return
        pack_part(pending, pending[4], pending[5])
        self._packed(pending[0])

    def _packed(self, buf: torch.Tensor) -> None:
        """The lazy publish into ``buf`` is packed (nothing if another one is pending now):
        its buffer is used, and whole if one part."""
        with self._lock:
            pending = self._pending
            if pending is None or pending[0] is not buf:
                return
            self._pending = None
            self._buffers.used(buf)
            if self.part[1] == 1:
                self._hold_whole(self.version, buf, self.head)

    def _hold_whole(self, version: int, buf: torch.Tensor, head: int) -> None:
        """``buf`` holds ``version`` whole: the newest one held, unless a newer one is (the
        caller holds :attr:`_lock`; a round finishing late never moves it back)."""
        if self._whole is None or version > self._whole[0]:
            self._whole = (version, buf, head)

    def whole(self) -> tuple[int, torch.Tensor | None]:
        """The newest version held complete, and its buffer (``(0, None)``: none yet): what
        :meth:`pull` loads and an ingress serves, never a part still missing others'. CUDA:
        the caller's stream waits for the transfer that filled it (on the device)."""
        got = self._whole
        if got is None:
            return 0, None
        if isinstance(got[1], InFiles):  # read in place: one copy per version, when asked
            return self._reading(lambda v, files, head: self._copied(v, files))
        self._buffers.wait(got[1])
        return got[0], got[1]

    def _copied(self, version: int, files: InFiles) -> tuple[int, torch.Tensor]:
        """``files`` copied into one buffer, once per version (``whole()`` on a receiver that
        reads in place: an ingress serving attached producers asks every round)."""
        kept = self._copy
        if kept is None or kept[0] != version:
            kept = self._copy = (version, files.whole(self._buffers.take(files.nbytes)))
        return kept

    def _reading(self, read):
        """Run ``read(version, buf, head)`` on the newest whole version, held (reported in the
        meta, ``held``) while it runs if it is read in place from files; one such read at a
        time (``_pulling`` is one version)."""
        with self._read_lock:
            with self._lock:
                version, buf, head = self._whole
                files = isinstance(buf, InFiles)
                if files:
                    self._pulling = version
            try:
                return read(version, buf, head)
            finally:
                if files:
                    with self._lock:
                        self._pulling = 0

    def publish(
        self, module: nn.Module, part: tuple[int, int] = (0, 1), lazy: bool = False
    ) -> None:
        """Pack ``module``'s state (names, shapes, dtypes and values) into a buffer nobody
        holds (not the current one) and bump the version.

        Args:
            module: the weights.
            part: ``(index, count)``: pack only bytes :func:`parts` gives ``index`` of
                ``count`` senders (learners holding the same weights; a round completes the
                buffer from the others). ``(0, 1)``: the whole buffer.
            lazy: pack nothing now: the round that sends this version packs each bucket
                just before sending it (the pack overlaps the transfer). Only for a caller
                that runs that round before ``module`` may change, then :meth:`settle`
                (``TokenPlane.publish_weights(send_now=True)``).

        Raises:
            SpecError: if the module has no state or a tensor of an unsupported dtype, or
                ``part`` is not an index below a count >= 1.
        """
        index, count = part
        if not (isinstance(count, int) and count >= 1 and isinstance(index, int)) or not (
            0 <= index < count
        ):
            raise SpecError(
                f"weights: part: expected (index, count), 0 <= index < count, got {part}"
            )
        state = checked_state(module)
        key = tuple((n, t.dtype, tuple(t.shape), _placed(t)) for n, t in state.items())
        if self._head is None or self._head[0] != key:  # the header only when the layout changes
            entries = entries_of(state)
            shards = shards_of(state, entries)
            head, total = header_of(entries, shards)
            digest = 0
            if self.device is not None:  # its digest, and its layout known without a read
                digest = head_digest(head)
                self._layouts[digest] = decode(head, total)
            self._head = (key, head, total, entries, digest, shards)
        _, head, total, entries, digest, shards = self._head
        if shards is not None:  # sharded (FSDP2): this rank packs what it holds, never lazily
            part, lazy = _holder(shards), False
            index, count = part
        self.settle()  # an earlier lazy publish never sent: packed before it is replaced
        if self.files is not None:  # packed into a file of this rank's: the pack is the send
            self.slot, buf = self.files.take(total, self.version + 1)
            lazy = False
        else:
            buf = self._buffers.take(total)
        if shards is not None:
            fill_shards(buf, head, entries, state, shards.ranges[index])
            self._buffers.used(buf)
        else:
            lo, hi = parts(total, count)[index]
            if not lazy:
                fill(buf, head, entries, state, lo, hi)
                self._buffers.used(buf)
        with self._lock:
            if lazy:
                self._pending = (buf, head, entries, state, lo, hi)
            self.buf, self.part = buf, (index, count)  # complete (its part) before current
            self.head = digest  # 0 on a host plane: receivers read the header in place
            self.shard_head = 0 if shards is None else align(len(head))
            self.version += 1
            if count == 1 and not lazy:
                self._hold_whole(self.version, buf, digest)

    def exchange(
        self,
        ex: Exchange,
        owners: int | Sequence[int],
        version: int,
        nbytes: int,
        r: int,
        snap,
        head: int = 0,
        receivers: Sequence[int] | None = None,
        slots: Sequence[int] = (),
        shard_head: int = 0,
    ) -> None:
        """Send version ``version`` from its owners to its receivers if it is newer than the
        last one sent (every rank of the group calls it, with the same arguments but ``snap``).

        Each owner holds part ``i`` of ``len(owners)`` (:func:`parts`) and sends it, in buckets
        of :attr:`bucket_bytes`, to every receiver that is not itself (``"p2p"``, or a
        ``"relay"`` across hosts where the bandwidth model prices it cheaper: :meth:`routes`,
        run step by step by ``_sends``), or broadcasts it to the group where the backend has no
        send/recv for the buffer's device (``"broadcast"``: CUDA over gloo), or, with weights
        files (``"shm"``), receivers copy the parts out of the owners' files. A receiver's
        buffer becomes its current one, whole, only after every bucket arrived, and only if it
        is newer than what the rank holds.

        Args:
            ex: the plane's collectives.
            owners: the ranks that packed the version, in part order (one rank: the whole).
            version: the owners' version, from the round's meta (the same on every rank).
            nbytes: the byte count of the buffer, from the meta.
            r: the round number.
            snap: this rank's :class:`WeightsSnapshot` (the part sent when this rank owns
                one).
            head: the owners' header digest, from the meta (device buffers; 0: none).
            receivers: the ranks that load the whole version (default: every rank that is
                not an owner). An owner among them also receives the others' parts.
            slots: each owner's weights file, from the meta (shared memory: schedule
                ``"shm"``, each receiver copies every part out of its owner's file).
            shard_head: a sharded state's header bytes, from the meta (0: not sharded). The
                first owner sends the header first; every rank taking part reads from it which
                bytes each owner holds (its ``"shards"``) instead of :func:`parts`.

        Raises:
            SpecError: if a sharded state's holders are not the owners.
        """
        if version <= self.broadcast:
            return
        owners = (owners,) if isinstance(owners, int) else tuple(owners)
        rank = ex.rank
        if receivers is None:
            receivers = [q for q in range(ex.world) if q not in owners]
        receiving = rank in receivers
        t0 = time.perf_counter()
        cuda = self.device is not None and self.device.type == "cuda"
        schedule = "shm" if self.files is not None else weights_schedule(ex, cuda)
        if rank in owners:
            buf = snap.buf
            self._buffers.wait(buf)  # CUDA: its pack, before a send reads it
        elif schedule == "shm" and receiving:  # read in place: the owners' files, no copy
            buf = None
        elif receiving or schedule == "broadcast":  # a broadcast: every rank takes part
            buf = self._buffers.take(nbytes)
        else:  # nothing to send or receive here
            self.broadcast = version
            return
        if shard_head:
            ranges = self._shard_ranges(
                ex, owners, receivers, buf, shard_head, slots, r, nbytes, schedule
            )
        else:
            ranges = [[p] for p in parts(nbytes, len(owners))]
        pack = snap.pack if rank in owners else None
        if schedule == "shm" and buf is None:  # a receiver reads the owners' files in place
            buf, received, count = self._in_files(owners, ranges, slots, nbytes)
            sent = 0
        elif schedule == "shm":
            sent, received, count = self._files(owners, ranges, receiving, buf, slots, r)
        elif schedule == "broadcast":  # every rank takes part; owners receive the others' parts
            sent, received, count = self._broadcasts(ex, owners, ranges, buf, pack, r)
            receiving = receiving or rank in owners
        else:
            schedule, phases = self.routes(owners, ranges, receivers, cuda)
            sent, received, count = self._sends(ex, phases, buf, pack, r)
            if pack is not None and not any(route[0] == rank for route in phases[0]):
                for lo, hi in ranges[owners.index(rank)]:  # nobody to send to: packed all the same
                    pack(lo, hi)
        if pack is not None:
            self._packed(buf)
        if not isinstance(buf, InFiles):
            self._buffers.used(buf)  # CUDA: the transfer on the round's stream, before a reuse
        self.broadcast = version
        self.last = Transfer(
            version, schedule, owners, sent, received, count, time.perf_counter() - t0
        )
        tot = self.totals
        tot["transfers"] += 1
        tot["seconds"] += self.last.seconds
        tot["sent"] += sent
        tot["received"] += received
        with self._lock:  # a publish on the caller's thread may have moved on meanwhile
            if rank not in owners and receiving and version > self.version:
                self.buf = None if isinstance(buf, InFiles) else buf  # nothing to send from
                self.version, self.head, self.part = version, head, (0, 1)
                self.slot = -1
            if receiving or (rank in owners and len(owners) == 1):
                self._hold_whole(version, buf, head)

    def _sends(self, ex, phases, buf, pack, r) -> tuple[int, int, int]:
        """The ``"p2p"`` and ``"relay"`` schedules: ``phases`` of routes ``(src, dst, lo, hi)``
        (the same list on every rank) run one after the other, a relay forwarding in the second
        what arrived in the first. A phase goes in steps: step ``k`` is one batch of this
        rank's receives and sends of every route's ``k``-th bucket, so each batch's sends and
        receives are matched within the same step on both sides (NCCL runs a rank's batches in
        order: two ranks sending to each other in separate batches could each wait on the
        other's), and an owner's ``k``-th bucket is packed (``pack``) just before its step, the
        pack of the next overlapping the last one's transfer. Returns (sent, received,
        buckets) in payload bytes."""
        rank, size = ex.rank, self.bucket_bytes
        sent = received = count = 0
        for phase in phases:
            mine = [route for route in phase if rank in (route[0], route[1])]
            steps = max((-(-(hi - lo) // size) for _, _, lo, hi in phase), default=0)
            works, packed = [], set()
            for k in range(steps):
                ops = []
                for src, dst, lo, hi in mine:
                    a = lo + k * size
                    if a >= hi:
                        continue
                    b = min(a + size, hi)
                    if dst == rank:
                        ops.append(dist.P2POp(dist.irecv, buf[a:b], src, ex.group))
                        received += b - a
                    else:
                        if pack is not None and a not in packed:
                            pack(a, b)
                            packed.add(a)
                        ops.append(dist.P2POp(dist.isend, buf[a:b], dst, ex.group))
                        sent += b - a
                    count += 1
                if ops:
                    works += ex.send_recv_start(ops, "weights[p2p]", r)
            ex.wait_works(works, "weights[p2p]", r, buf.is_cuda)
            pack = None  # packed in the first phase: later ones forward what arrived
        return sent, received, count

    def _shard_ranges(
        self, ex, owners, receivers, buf, head, slots, r, nbytes, schedule: str
    ) -> list[list[tuple]]:
        """A sharded state's header to every receiver (from the first owner, by the round's
        ``schedule``), and from it each owner's byte ranges (:class:`~conduit_dist.flow.
        weights_format.Shards`: holders are global ranks, owners the group's)."""
        src = owners[0]
        if schedule == "shm":  # an owner's file holds the header; a receiver reads the first
            if buf is None:  # owner's in place
                buf = self.files.peer(src, int(slots[0]), nbytes)
        elif schedule == "broadcast":
            self._broadcasts(ex, [src], [[(0, head)]], buf, None, r)
        else:  # p2p (a header is not worth a relay)
            self._sends(ex, [[(src, d, 0, head) for d in receivers if d not in owners]], buf,
                        None, r)  # fmt: skip
        raw = buf[:head]
        if raw.is_cuda:
            raw = raw.cpu()
            SYNCS.add("weights header")
        head_bytes = raw.numpy().tobytes()
        known = self._shards_known  # the last header's shards: decoded once per layout
        if known is None or known[0] != head_bytes:
            known = self._shards_known = (head_bytes, decode(head_bytes, nbytes).shards)
        shards = known[1]
        if shards is None:
            raise SpecError(
                f"weights: round {r}: the meta announced a sharded state, the first owner's "
                f"header (rank {src}) has no shards: a corrupted or mismatched buffer"
            )
        try:
            group = [dist.get_group_rank(ex.group, g) if ex.group is not None else g
                     for g in shards.holders]  # fmt: skip
        except (ValueError, RuntimeError) as exc:
            raise SpecError(
                f"weights: round {r}: the state is sharded over global ranks "
                f"{list(shards.holders)}, not all in the plane's group: {exc}"
            ) from exc
        if sorted(group) != sorted(owners):
            raise SpecError(
                f"weights: round {r}: the state is sharded over ranks {group} (group ranks), "
                f"the learners sending it are {list(owners)}: expected the same ranks (every "
                "holder of a shard publishes the same version at the same point)"
            )
        start = head
        return [[(start + lo, start + hi) for lo, hi in shards.ranges[group.index(o)]]
                for o in owners]  # fmt: skip

    def routes(
        self, owners, ranges, receivers, cuda: bool = False
    ) -> tuple[str, list[list[tuple]]]:
        """The sends of a ``"p2p"`` transfer: phases of routes ``(src, dst, lo, hi)``.

        Each owner's part straight to each receiver (``"p2p"``), or, where the bandwidth
        model prices it cheaper, ``"relay"``: a host with several receivers and no owner gets
        each part once over its link (owner ``i``'s to its ``i``-th receiver, round robin) and
        its receivers pass the parts on among themselves (docs/weights.md). ``ranges``: each
        owner's ``[lo, hi)`` byte ranges (one per owner from :func:`parts`; a sharded
        state's own). ``cuda``: priced by the plane's model of device transfers."""
        direct = [
            (o, d, lo, hi)
            for o, rs in zip(owners, ranges)
            for lo, hi in rs
            for d in receivers
            if d != o
        ]
        relay = _relay(owners, ranges, receivers, self.transport)
        if relay is None:
            return "p2p", [direct]
        t = self.transport
        model, links = (t.device_model if cuda else t.model), t.links
        world = len(links)

        def price(phase) -> float:
            m = np.zeros((world, world), dtype=np.int64)
            for src, dst, lo, hi in phase:
                m[src, dst] += hi - lo
            return model.predict("p2p", m, links)

        if sum(price(p) for p in relay) < price(direct):
            return "relay", relay
        return "p2p", [direct]

    def _files(self, owners, ranges, receiving, buf, slots, r) -> tuple[int, int, int]:
        """The ``"shm"`` schedule: an owner's part is in its file already (packed there);
        a receiver copies every other owner's part out of that owner's file. Returns (bytes
        packed for others, received, parts copied)."""
        files, rank, nbytes = self.files, self.files.rank, buf.numel()
        sent = received = count = 0
        for src, slot, rs in zip(owners, slots, ranges):
            if src == rank:
                files.sent(int(slot), nbytes, r)
                sent += sum(hi - lo for lo, hi in rs)
            elif receiving:
                peer = files.peer(src, int(slot), nbytes)
                for lo, hi in rs:
                    buf[lo:hi].copy_(peer[lo:hi])
                    received += hi - lo
                count += 1
        return sent, received, count

    def _in_files(self, owners, ranges, slots, nbytes) -> tuple[InFiles, int, int]:
        """The ``"shm"`` schedule on a receiver that is no owner: the version is read in place,
        each owner's ranges in its file (copied or viewed by ``pull``, nothing here). Returns
        it, the bytes it holds and the owners' files mapped."""
        files = self.files
        pieces = []
        for src, slot, rs in zip(owners, slots, ranges):
            peer = files.peer(src, int(slot), nbytes)
            pieces += [(lo, hi, peer, (src, int(slot))) for lo, hi in rs]
        pieces.sort(key=lambda p: p[0])
        parts_bytes = sum(p[1] - p[0] for p in pieces)  # the owners' parts (no header alone)
        if pieces and pieces[0][0] > 0:  # the header (sharded: every owner writes it)
            first = (owners[0], int(slots[0]))
            pieces.insert(0, (0, pieces[0][0], files.peer(*first, nbytes), first))
        got = InFiles(nbytes, tuple(p[:3] for p in pieces), tuple(p[3] for p in pieces))
        return got, parts_bytes, len(owners)

    def held(self) -> tuple[int, int, int, int]:
        """The versions this rank reads from other ranks' weights files: held whole, being
        pulled, and the oldest and newest viewed by modules ``pull(in_place=True)`` loaded
        (while a tensor on one of those mappings lives: storage use counts); 0: none. Each
        round's meta carries them, and no learner packs a file of those versions (or between
        the oldest and newest viewed) again (``WeightFiles.take``)."""
        with self._lock:
            self._views = [(v, bases) for v, bases in self._views
                           if not all(p.free() for p in bases)]  # fmt: skip
            viewed = [v for v, _ in self._views]
            lo, hi = (min(viewed), max(viewed)) if viewed else (0, 0)
            v, b, _ = self._whole or (0, None, 0)  # held whole in other ranks' files
            return v if isinstance(b, InFiles) else 0, self._pulling, lo, hi

    def close(self) -> None:
        """Remove this rank's weights files (shared memory); nothing otherwise."""
        if self.files is not None:
            self.files.close()

    def _broadcasts(self, ex, owners, ranges, buf, pack, r) -> tuple[int, int, int]:
        """The ``"broadcast"`` schedule: each owner's part broadcast bucket by bucket to the
        whole group (every rank takes part). Returns (sent, received, buckets)."""
        sent = received = count = 0
        for src, rs in zip(owners, ranges):
            for a, b in (piece for lo, hi in rs for piece in buckets(lo, hi, self.bucket_bytes)):
                if pack is not None and src == ex.rank:
                    pack(a, b)
                ex.broadcast(buf[a:b], src, r)
                count += 1
                if src == ex.rank:
                    sent += (b - a) * (ex.world - 1)
                else:
                    received += b - a
        return sent, received, count

    def state_dict(self) -> dict[str, int]:
        """The last version broadcast (the same on every rank; versions are owned by
        ``flow.versions.PolicyVersions``, the weights themselves by the caller's checkpoint)."""
        return {"broadcast": self.broadcast}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore :meth:`state_dict` (a version already broadcast is not sent again)."""
        self.broadcast = int(state["broadcast"])

    def hold(self, version: int, buf: torch.Tensor, head: int = 0) -> None:
        """Make ``buf``, a whole buffer of ``version`` received outside a round (an attached
        producer's pull, a test), the current one: it replaces what is held, whatever its
        version (not for a state a plane's rounds also move)."""
        with self._lock:
            self.buf, self.version, self.head, self.part = buf, version, head, (0, 1)
            self._whole = (version, buf, head)

    def pull(self, module: nn.Module, in_place: bool = False) -> int:
        """Load the newest whole version into ``module`` after checking their layout against
        its state_dict; nothing is loaded when they differ.

        Args:
            module: the module to load (its state_dict's names, shapes and dtypes must be the
                published ones).
            in_place: instead of copying, make ``module``'s parameters and buffers views of
                the received buffer (``load_state_dict(..., assign=True)``; ``requires_grad``
                kept): no copy per load, for producers that only run the module. The buffer is
                then never reused while the module holds it (storage use counts); views of a
                tied weight become two tensors of equal values; an optimizer holding the old
                parameters no longer sees the module's. Read in place from the learners'
                ``/dev/shm`` files (shared memory), the views are of fresh copy-on-write
                mappings of those files (a write stays this rank's; a tensor straddling two
                learners' parts is copied; a sharded publish is copied once), and no learner
                packs those files again while a tensor on them lives (:meth:`held`).

        Returns:
            The version loaded (0: none published or received yet).

        Raises:
            SpecError: if the buffer is truncated or corrupted, or its names, shapes or dtypes
                differ from the module's (each difference listed: name, expected, received).
        """
        if self._whole is None:
            return 0

        def read(version: int, buf, head: int) -> int:
            self._load(module, version, buf, head, in_place)
            return version

        return self._reading(read)

    def _load(self, module: nn.Module, version: int, buf, head: int, in_place: bool) -> None:
        """``pull``'s check and load of ``buf`` (a buffer, or :class:`InFiles`: copied or
        viewed straight out of the owners' files, a tensor straddling two owners copied)."""
        files = isinstance(buf, InFiles)
        if not files:
            self._buffers.wait(buf)  # CUDA: after the round's transfer into it, on the device
        # by version and address: a reused buffer holds a new version, and the layout decoded
        # is always that of the buffer copied from
        if self.device is not None:
            layout = self._device_layout(buf, head)
        else:
            key = (version, id(buf) if files else buf.data_ptr())
            decoded = self._decoded
            if decoded is None or decoded[:2] != key:
                decoded = self._decoded = (*key, decode(buf.head() if files else buf))
            layout = decoded[2]
        state = checked_state(module)
        mine = entries_of(state)
        diff = differences(mine, layout.entries)
        if diff:
            mine_bytes = sum(e.nbytes for e in mine.values())
            got_bytes = sum(e.nbytes for e in layout.entries.values())
            raise SpecError(
                f"weights: the published weights ({len(layout.entries)} tensors, {got_bytes} "
                f"bytes) do not match the module's state_dict ({len(mine)} tensors, {mine_bytes} "
                f"bytes): {'; '.join(diff)}. Is the module the learner's architecture?"
            )
        sharded = [n for n, t in state.items() if is_dtensor(t)]
        if in_place and sharded:
            raise SpecError(
                f"weights: pull(in_place=True) into a sharded module ({sharded[0]!r} is a "
                "DTensor): expected an unsharded one; pull(in_place=False) copies this rank's "
                "rows into its shards"
            )
        bases = []
        if files and layout.shards is not None:
            # a sharded publish: every tensor's rows lie in several files, so no view of one
            # file holds a tensor: one copy into a pooled buffer (kept for this version, and
            # never reused while a module views it), loaded from as a received buffer is
            buf, files = self._copied(version, buf)[1], False
        if files and in_place:  # copy-on-write mappings: the module's writes stay its own
            buf = buf.private(self.files)
            # each mapping's use count, before any view of it: a version is viewed while a
            # tensor on one of its mappings lives (held() reports it)
            bases = [Pooled(f) for f in {id(f): f for _, _, f in buf.pieces}.values()]
        views = {}
        for name in state:
            e = layout.entries[name]
            at = layout.start + e.offset
            if files:  # in the one owner's file holding it, else copied from two
                raw = buf.span(at, at + e.nbytes)
                if raw is None:
                    raw = torch.empty(e.nbytes, dtype=torch.uint8)
                    buf.read(at, at + e.nbytes, raw)
            else:
                raw = buf[at : at + e.nbytes]
            views[name] = raw.view(e.dtype).view(e.shape)
        fresh = {}
        if in_place:
            module.load_state_dict(views, strict=True, assign=True)
        else:
            with self._lock:  # the mappings modules loaded in place view (a copy replaces them)
                spans = [(p.buf.data_ptr(), p.buf.data_ptr() + p.buf.numel())
                         for _, viewed in self._views for p in viewed]  # fmt: skip
            with torch.no_grad():
                for name, t in state.items():
                    if is_dtensor(t):  # this rank's rows of it (or all, replicated)
                        local, r0 = local_rows(name, t, mine[name])
                        got = views[name]
                        local.copy_(got if local.dim() == 0 else got[r0 : r0 + local.shape[0]])
                    elif any(a <= t.data_ptr() < b for a, b in spans):
                        fresh[name] = views[name].clone()  # a file's view: a tensor of its own
                    else:
                        t.copy_(views[name])
            if fresh:
                module.load_state_dict(fresh, strict=False, assign=True)
        del views
        if bases:
            with self._lock:  # the versions modules view from here on (held, WVIEW)
                self._views.append((version, bases))
        if not files:
            self._buffers.used(buf)

    def _device_layout(self, buf: torch.Tensor, head: int) -> Layout:
        """A device buffer's layout: known by its header digest, or read once (its preamble
        and header to the host: a counted sync), checked against the digest."""
        layout = self._layouts.get(head)
        if layout is not None:
            return layout
        size = buf.numel()
        first = buf[: min(size, PREAMBLE.size)].cpu()
        SYNCS.add("weights header")
        hlen = PREAMBLE.unpack(first.numpy().tobytes())[2] if size >= PREAMBLE.size else 0
        raw = buf[: min(size, PREAMBLE.size + hlen)].cpu().numpy().tobytes()
        got = head_digest(raw)
        if head and got != head:
            raise SpecError(
                f"weights: the received header's digest {got:#x} differs from the one the "
                f"publisher announced, {head:#x}: a corrupted or mismatched buffer"
            )
        layout = decode(raw, size)
        self._layouts[got] = layout
        return layout


def _placed(t) -> tuple:
    """What of a state tensor's placement its buffer's layout depends on (a DTensor's mesh
    ranks and placements; nothing for a plain tensor)."""
    if not is_dtensor(t):
        return ()
    return (tuple(t.device_mesh.mesh.reshape(-1).tolist()), str(tuple(t.placements)))


def _holder(shards) -> tuple[int, int]:
    """This process's ``(index, count)`` among a sharded state's holders.

    Raises:
        SpecError: if this rank holds none of its shards.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank not in shards.holders:
        raise SpecError(
            f"weights: rank {rank} publishes a state sharded over ranks "
            f"{list(shards.holders)}: expected it to be one of them"
        )
    return shards.holders.index(rank), len(shards.holders)


def _relay(owners, ranges, receivers, transport) -> list[list[tuple]] | None:
    """The two phases of a relay (see :meth:`WeightsState.routes`), or ``None`` where no host
    has two receivers and no owner."""
    if transport is None:
        return None
    host = transport.topo.host_of
    by_host: dict[int, list[int]] = {}
    for d in receivers:
        if d not in owners:
            by_host.setdefault(host[d], []).append(d)
    owner_hosts = {host[o] for o in owners}
    relayed = {h: rs for h, rs in by_host.items() if len(rs) >= 2 and h not in owner_hosts}
    if not relayed:
        return None
    first, second = [], []
    for i, (o, pieces) in enumerate(zip(owners, ranges)):
        for lo, hi in pieces:
            for d in receivers:
                if d != o and (d in owners or host[d] not in relayed):
                    first.append((o, d, lo, hi))  # straight, as without a relay
            for rs in relayed.values():
                entry = rs[i % len(rs)]
                first.append((o, entry, lo, hi))
                second += [(entry, d, lo, hi) for d in rs if d != entry]
    return [first, second]


def weights_schedule(ex, cuda: bool) -> str:
    """How a round moves weights on ``ex``: ``"p2p"`` (sends and receives: gloo for host
    buffers, NCCL for CUDA ones) or ``"broadcast"`` (CUDA buffers through gloo, which has no
    send/recv for them; ``Exchange.cuda_backend``)."""
    return "broadcast" if cuda and getattr(ex, "cuda_backend", "") == "gloo" else "p2p"
