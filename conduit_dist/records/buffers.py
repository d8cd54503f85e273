"""Growable record buffers for staging and delivery (allocated once, reused every round)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from conduit_dist.syncs import wait_event


def lasting_empty(*size: int, **kwargs) -> torch.Tensor:
    """``torch.empty`` that makes a normal tensor even inside ``torch.inference_mode()``.

    Pooled buffers outlive the call that allocates them: one first made while an actor or an
    evaluation ran under inference mode would be an inference tensor, and so would every batch
    later handed out of it, which autograd then refuses to save for backward."""
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False):
            return torch.empty(*size, **kwargs)
    return torch.empty(*size, **kwargs)


class RecordBuffer:
    """A reusable ``uint8 [rows, record_bytes]`` buffer that grows by doubling and never shrinks.

    Args:
        record_bytes: bytes per record.
        device: where the buffer lives.
        rows: initial capacity in records.
        pin_memory: allocate page-locked host memory (CUDA machines only).
    """

    def __init__(
        self, record_bytes: int, device: torch.device, rows: int = 256, pin_memory: bool = False
    ) -> None:
        self.record_bytes = record_bytes
        self.device = device
        self.pin_memory = pin_memory
        self.data = self._alloc(max(rows, 1))
        self.count = 0
        self.deferred: list[tuple[int, object]] = []  # (first row, donated batch) to pack later
        self.packed: list[object] = []  # donated batches packed by the current round
        # CUDA: the event of the round that last read the buffer (its copies out of it, the
        # packing of donated batches); the buffer is written again only once it has passed
        self.read_event = None

    def _alloc(self, rows: int) -> torch.Tensor:
        return lasting_empty(
            (rows, self.record_bytes),
            dtype=torch.uint8,
            device=self.device,
            pin_memory=self.pin_memory,
        )

    def ensure(self, rows: int) -> None:
        """Grow (keeping the first ``count`` records) so at least ``rows`` records fit."""
        if rows <= self.data.shape[0]:
            return
        new = self._alloc(max(rows, 2 * self.data.shape[0]))
        new[: self.count].copy_(self.data[: self.count])
        self.data = new

    def reserve(self, n: int) -> torch.Tensor:
        """Rows ``[count, count + n)`` to write into; they count once :meth:`commit` is called."""
        self.ensure(self.count + n)
        return self.data[self.count : self.count + n]

    def commit(self, n: int) -> None:
        """Keep ``n`` reserved rows."""
        self.count += n

    def defer(self, n: int, batch: object) -> None:
        """Reserve ``n`` rows for a donated batch, packed later by :meth:`pack_deferred`."""
        self.ensure(self.count + n)
        self.deferred.append((self.count, batch))
        self.count += n

    def pack_deferred(self, spec) -> None:
        """Pack the donated batches into their reserved rows (in the round, not in ``put``)."""
        for start, batch in self.deferred:
            n = next(iter(batch.values())).shape[0]
            spec.pack(batch, self.data[start : start + n])
        # kept until the buffer is reused, after the round has finished: on CUDA the packing
        # copies run on the round's stream, and a donated tensor freed earlier could be handed
        # back to the consumer's stream by the caching allocator while they still read it
        self.packed.extend(b for _, b in self.deferred)
        self.deferred.clear()

    def drop_oldest(self, k: int) -> None:
        """Drop the first ``k`` committed records (deferred batches must be packed already)."""
        if self.deferred:
            raise RuntimeError("drop_oldest: pack the deferred batches first")
        keep = self.count - k
        if k == self.count:
            self.reset()
            return
        self.data[:keep] = self.data[k : self.count].clone()
        self.count = keep

    def reset(self) -> None:
        """Empty the buffer (keeping its memory), once the round that last read it has passed
        its copies (``read_event``): host memory waits on the host (no sync when it has passed,
        a counted one when not); device memory is written by the caller's stream, which waits
        for the event on the device."""
        if self.read_event is not None:
            if self.data.is_cuda:  # CUDA only
                torch.cuda.current_stream(self.data.device).wait_event(self.read_event)
            else:
                wait_event(self.read_event, "staging reuse")
            self.read_event = None
        self.count = 0
        self.deferred.clear()
        self.packed.clear()

    def rows(self, n: int) -> torch.Tensor:
        """The first ``n`` rows as scratch space (growing if needed; contents not kept)."""
        if n > self.data.shape[0]:
            self.data = self._alloc(max(n, 2 * self.data.shape[0]))
        return self.data[:n]

    def view(self) -> torch.Tensor:
        """The committed records."""
        return self.data[: self.count]


class Prefixes:
    """A reusable 1-D tensor that grows by doubling and hands out its first ``n`` elements as
    views cached by ``n`` (a torch slice costs ~1 us, a dict lookup less; callers' sizes repeat).
    A view stays valid until the next :meth:`first` (the buffer is shared, and may grow).

    Args:
        dtype: the elements' dtype.
        device: where the buffer lives.
        size: initial capacity in elements.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device, size: int = 256) -> None:
        self.dtype, self.device = dtype, device
        self._alloc(size)

    def _alloc(self, size: int) -> None:
        self.data = lasting_empty(size, dtype=self.dtype, device=self.device)
        self.host = self.data.numpy() if self.data.is_cpu else None  # None off the host
        self._views: dict[int, torch.Tensor] = {}

    def first(self, n: int) -> torch.Tensor:
        """The first ``n`` elements (growing the buffer first when it is smaller)."""
        view = self._views.get(n)
        if view is None:
            if self.data.shape[0] < n:
                self._alloc(max(n, 2 * self.data.shape[0]))
            if len(self._views) > 64:  # sizes that keep changing: keep the cache small
                self._views = {}
            view = self._views[n] = self.data[:n]
        return view


class DoubleBuffer:
    """Two staging buffers: ``put`` fills one while a round reads the other.

    Args:
        record_bytes: bytes per record.
        device: where staged records live.
        pin_memory: page-locked host memory (CUDA machines only).
    """

    def __init__(self, record_bytes: int, device: torch.device, pin_memory: bool = False) -> None:
        self._bufs = [RecordBuffer(record_bytes, device, pin_memory=pin_memory) for _ in range(2)]
        self._cur = 0

    @property
    def current(self) -> RecordBuffer:
        """The buffer ``put`` writes into."""
        return self._bufs[self._cur]

    def take(self) -> RecordBuffer:
        """Hand the filled buffer to a round and switch ``put`` to the other (emptied) one."""
        full = self._bufs[self._cur]
        self._cur ^= 1
        self._bufs[self._cur].reset()
        return full


def use_count(t: torch.Tensor) -> int | None:
    """How many tensors hold ``t``'s storage (``None`` where torch does not say)."""
    fn = getattr(torch._C, "_storage_Use_Count", None)
    return None if fn is None else int(fn(t.untyped_storage()._cdata))


class Pooled:
    """One pooled buffer, the field views built once for it (or its numpy view: host
    buffers read by numpy), and its idle storage use count."""

    __slots__ = ("array", "buf", "idle", "read", "released", "views")

    def __init__(self, buf: torch.Tensor, array: np.ndarray | None = None) -> None:
        self.buf, self.views, self.array = buf, None, array
        # just allocated: nothing else holds it yet (``array``, a reference of its own, counted)
        self.idle = use_count(buf)
        self.read = None  # pinned host buffers: the CUDA event of the last copy reading them
        # CUDA buffers handed out: the event on the consumer's stream after which no kernel
        # reads it (OutputPool.release_point); None: not released since it was handed out
        self.released = None

    def free(self) -> bool:
        """Nobody outside the pool holds a tensor on the buffer's storage (every tensor handed
        out is a distinct tensor on it, so the storage's use count sees each holder)."""
        return use_count(self.buf) == self.idle

    def view_fields(self, unpack) -> dict[str, torch.Tensor]:
        """Fresh field tensors of the whole buffer (``detach`` of views built once: ~0.5 us a
        field where building them cost ~3 us; a caller's in-place metadata change, such as
        ``unsqueeze_`` or ``requires_grad_``, never reaches a later batch)."""
        if self.views is None:  # the idle count then includes the kept views
            # by what building them added, not by a fresh count: a tensor someone else still
            # holds on the buffer right now (the caller's batch, a slice a finished exchange's
            # thread has not released yet) would be counted as idle, and the buffer handed
            # out again while that holder still reads it
            before = use_count(self.buf)
            self.views = unpack(self.buf)
            self.idle += use_count(self.buf) - before
        return {k: v.detach() for k, v in self.views.items()}


def keep(pool: list[Pooled], entry: Pooled, size: int) -> None:
    """Add ``entry`` to ``pool``; past ``size`` entries the smallest buffer nobody holds leaves
    the pool, else the smallest (whoever holds it keeps it alive): buffers of a size no longer
    asked for give way to the new one."""
    if len(pool) >= size:
        pool.sort(key=lambda e: e.buf.shape[0])
        pool.remove(next((e for e in pool if e.free()), pool[0]))
    pool.append(entry)


class OutputPool:
    """Delivery buffers handed to the caller and reused once the caller has dropped them.

    Touching fresh memory costs far more than copying into memory already touched (first fill
    ~0.5 GB/s here), so a fetched batch lands in one of a few pooled buffers on whose storage
    nobody else holds a tensor any more (storage use counts; every field tensor handed out is its
    own tensor on it). Where torch does not expose use counts, every batch gets a fresh buffer
    (correct, slower). The buffer itself never leaves the plane.

    On CUDA a reused buffer is written by the round's side stream, so every kernel that read its
    previous batch must come first. The consumer's thread calls :meth:`release_point` whenever a
    round is prepared: each buffer nobody holds at that moment gets an event recorded on the
    consumer's current stream (every kernel the caller enqueued while it held the buffer is
    before it), and only a buffer with such an event is handed to a round again, whose side
    stream waits for that event, not for the whole consumer stream (a backward running on it
    would otherwise hold the round's copies back). ``record_stream`` would not help here: it
    guards memory the caching allocator frees, and the pool never frees.

    A pinned host pool (rows composed on the host for a CUDA learner, see
    ``rounds.delivery.Landing``) is written by the host: a buffer is handed out again only after
    the device copy that last read it has finished (its event, :meth:`read_by`).

    Args:
        record_bytes: bytes per record.
        device: where buffers live.
        unpack: records -> field views (the spec's ``unpack``).
        size: buffers kept.
        pin_memory: page-locked host buffers (the source of non-blocking copies to a GPU).
    """

    def __init__(
        self, record_bytes: int, device: torch.device, unpack, size: int = 3,
        pin_memory: bool = False,
    ) -> None:  # fmt: skip
        self.record_bytes, self.device, self.size, self._unpack = record_bytes, device, size, unpack
        self.pin_memory = pin_memory
        self._pool: list[Pooled] = []
        self._empty: torch.Tensor | None = None
        self._cuda = torch.device(device).type == "cuda"
        if self._cuda:  # the batch held, the one being handed out, one released, one spare
            self.size = max(size, 4)

    def acquire(self, rows: int) -> torch.Tensor:
        """A ``[rows, record_bytes]`` buffer nobody else references."""
        if rows == 0:  # rounds without a fetch: one shared empty tensor
            if self._empty is None:
                self._empty = lasting_empty(
                    (0, self.record_bytes), dtype=torch.uint8, device=self.device
                )
            return self._empty
        for e in self._pool:
            if e.buf.shape[0] >= rows and e.free():
                if self._cuda:  # CUDA only: after the consumer's last kernels on it
                    if e.released is None:
                        continue  # not released at a release point yet: someone may read it
                    torch.cuda.current_stream(self.device).wait_event(e.released)
                    e.released = None
                if e.read is not None:  # the host writes it next: the last copy out is done
                    wait_event(e.read, "pinned delivery reuse")
                    e.read = None
                return e.buf if e.buf.shape[0] == rows else e.buf[:rows]
        buf = lasting_empty(
            (rows, self.record_bytes), dtype=torch.uint8, device=self.device,
            pin_memory=self.pin_memory,
        )  # fmt: skip
        if use_count(buf) is not None:
            keep(self._pool, Pooled(buf), self.size)
        return buf

    def release_point(self) -> None:
        """CUDA, on the consumer's thread: every pooled buffer nobody holds now gets an event on
        the consumer's current stream (one event for all), after which it may be written again
        (see the class docstring); nothing on the host."""
        if not self._cuda:
            return
        event = None
        for e in self._pool:
            if e.released is None and e.free():
                if event is None:
                    event = torch.cuda.current_stream(self.device).record_event()
                e.released = event

    def read_by(self, records: torch.Tensor, event) -> None:
        """A device copy (finished when ``event`` is) reads the pooled buffer ``records`` is
        on; it is not handed out again before then. A buffer not pooled (no use counts) is
        released by torch's pinned allocator only once that copy's stream has passed it."""
        ptr = records.untyped_storage().data_ptr()
        for e in self._pool:
            if e.buf.untyped_storage().data_ptr() == ptr:
                e.read = event
                return

    def unpack(self, records: torch.Tensor) -> dict[str, torch.Tensor]:
        """Field views of delivered ``records`` (cached per pooled buffer)."""
        for e in self._pool:
            if e.buf is records:
                return e.view_fields(self._unpack)
        return self._unpack(records)


class FieldPool:
    """Contiguous output fields of ``n`` rows carved out of one pooled buffer, handed out again
    once the caller has dropped every one of them (as :class:`OutputPool`'s buffers, by storage
    use counts); what a learner gets where the plane copies values out of delivered rows (n-step
    entries, ``_index`` and ``_weight``), so a fetch allocates no tensor in steady state.

    Args:
        fields: ``(name, dtype, shape)`` per field (shape without the row dimension).
        size: buffers kept (past it, the smallest one nobody holds leaves: :func:`keep`).
    """

    ALIGN = 64  # each field starts on its own cache line

    def __init__(
        self, fields: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], size: int = 3
    ) -> None:
        self.fields = tuple((name, dtype, tuple(shape)) for name, dtype, shape in fields)
        self._nbytes = [
            dtype.itemsize * math.prod(shape) for _, dtype, shape in self.fields
        ]  # per row
        self.size = size
        self._pool: list[Pooled] = []

    def take(self, n: int) -> dict[str, torch.Tensor]:
        """``name -> [n, *shape]`` contiguous tensors nobody else holds (contents undefined)."""
        for e in self._pool:
            if e.buf.shape[0] == n and e.free():
                return e.view_fields(self._carve)
        buf = self._flat(n)
        if use_count(buf) is None:  # no use counts: a fresh buffer every time (correct)
            return self._carve(buf)
        entry = Pooled(buf)
        keep(self._pool, entry, self.size)
        return entry.view_fields(self._carve)

    def _flat(self, n: int) -> torch.Tensor:
        """One uint8 ``[n, row]`` buffer whose bytes hold every field (``_carve`` lays them out
        field by field, each ``[n, ...]`` block aligned to ``ALIGN``)."""
        total = sum(-(-n * b // self.ALIGN) * self.ALIGN for b in self._nbytes)
        return lasting_empty((n, -(-total // max(n, 1))), dtype=torch.uint8)

    def _carve(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        n, flat, at, out = buf.shape[0], buf.view(-1), 0, {}
        for (name, dtype, shape), b in zip(self.fields, self._nbytes, strict=True):
            out[name] = flat[at : at + n * b].view(dtype).view(n, *shape)
            at += -(-n * b // self.ALIGN) * self.ALIGN
        return out
