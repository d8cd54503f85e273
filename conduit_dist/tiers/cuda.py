"""The CUDA side of the tiers, in one place so that one review can follow it.

On a machine without CUDA, or for tiers that are all in host memory, the shard's CUDA device is
``None`` and everything here returns at once; the lines past those early returns run only on
CUDA. The rules every tier follows:

- **Devices are resolved once.** A shard's tiers are on at most one CUDA device
  (:func:`cuda_device`), a ``cuda:<index>`` resolved when the tier was built, never "the
  current device" of whichever thread runs.
- **Copies into host memory are synchronous.** A copy from CUDA rows into a host tier (pinned,
  pageable or a mapped file) or into a host ``out`` is ``copy_(non_blocking=False)``, which waits
  for the *current stream* only (``cudaStreamSynchronize``), never the whole device: whatever
  reads those rows on the host next (the native gather, the demoter, a checkpoint's guard and
  writer, a sampler tagging delivered rows) sees them landed. Host readers are many and each
  would have to wait on a pending event; a round reads its rows in the same round anyway.
- **Copies into device memory are asynchronous**, ordered on the caller's current stream of
  the tier's device (the round's side stream). Indices built on the host go up through pinned
  memory from torch's caching host allocator (:func:`upload`), which does not hand that memory
  out again before the copy reading it has run (it records an event on the stream), so an upload
  never waits on the host. A tier's gathers upload into one reused device buffer
  (:class:`IndexUpload`), ordered by an event after its readers: no allocation per round.
- **Work on another thread has its own stream and events** (:class:`WorkerStream`): the
  demoter's stream waits for the stream that handed it work, and the streams that read its
  results wait for an event it records after its copies. These waits are on the device; the host
  goes on.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator

import torch

from conduit_dist.errors import ConfigError


def cuda_device(devices: Iterable[torch.device]) -> torch.device | None:
    """The one CUDA device among ``devices`` (the tiers' data devices), ``None`` if none is.

    Args:
        devices: where each tier's slots live.

    Returns:
        ``cuda:<index>`` shared by every CUDA tier, or ``None`` when every tier is in host memory.

    Raises:
        ConfigError: if CUDA tiers are on different devices (or one has no index): one shard's
            copies are ordered on one device's streams.
    """
    found = sorted({str(d) for d in devices if d.type == "cuda"})
    if not found:
        return None
    dev = torch.device(found[0])
    if len(found) > 1 or dev.index is None:
        raise ConfigError(
            "tiers: expected every device tier of a shard on one resolved cuda:<index>, "
            f"got {found}"
        )
    return dev


def upload(idx: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``idx`` on ``device``: itself when it is there already; from the host to CUDA without a
    host sync (a copy into pinned memory from torch's caching host allocator, then a
    non-blocking copy on the current stream; the allocator keeps that pinned block until the
    stream has passed the copy).

    Args:
        idx: an index tensor (e.g. int64 slots built on the host).
        device: where it is used.

    Returns:
        ``idx`` on ``device``.
    """
    if idx.device == device:
        return idx
    if not idx.is_cpu or device.type != "cuda":  # CUDA to host or between devices: torch's copy
        return idx.to(device)
    # CUDA only from here. A new pinned block, not idx.pin_memory(): that returns idx itself
    # when it is pinned already, and its owner may change it before the copy has run
    staged = torch.empty(idx.shape, dtype=idx.dtype, pin_memory=True)
    staged.copy_(idx)
    return staged.to(device, non_blocking=True)


class IndexUpload:
    """Host-built indices to one CUDA device through one reused device buffer, so that a device
    tier's gather asks the CUDA caching allocator for nothing, round after round (its pinned
    staging still comes from torch's caching host allocator, as in :func:`upload`).

    Reuse is ordered on the device: when the readers of an upload are enqueued (the end of
    :meth:`use`), an event is recorded on that stream, and the next upload's stream waits for it
    (the two may differ: a round's side stream, the caller's stream); the buffer is marked used
    by every stream that read it (``record_stream``), so the allocator hands it out again only
    after them once it is freed. Growing the buffer (geometric, so rarely) waits on the host for
    the last readers of the old one. Uploads of one tier are serialised by a lock (a plane's
    rounds already are).

    Args:
        device: the ``cuda:<index>`` the indices are used on.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buf = torch.empty(0, dtype=torch.int64, device=device)
        self._used = torch.cuda.Event()
        self._pending = False  # readers of an upload were enqueued and the event recorded
        self._streams: set[int] = set()  # streams recorded on the current buffer
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def use(self, idx: torch.Tensor) -> Iterator[torch.Tensor]:
        """``idx`` (int64 or int32, on the host) as int64 in the reused buffer on the device,
        ready on the current stream; enqueue every reader inside the ``with`` block (the tensor
        may be changed in place there, e.g. by ``remainder_``, and is overwritten after it)."""
        n = idx.numel()
        with self._lock:
            stream = torch.cuda.current_stream(self.device)
            if self._buf.numel() < n:
                if self._pending:
                    self._used.synchronize()  # the old buffer's readers ran: it can go back
                size = max(n, 2 * self._buf.numel())
                self._buf = torch.empty(size, dtype=torch.int64, device=self.device)
                self._streams = set()
            elif self._pending:
                stream.wait_event(self._used)  # the last readers (maybe on another stream) ran
            if stream.cuda_stream not in self._streams:
                self._buf.record_stream(stream)
                self._streams.add(stream.cuda_stream)
            staged = torch.empty(n, dtype=torch.int64, pin_memory=True)
            staged.copy_(idx.reshape(-1))
            out = self._buf[:n]
            out.copy_(staged, non_blocking=True)
            try:
                yield out.view(idx.shape)
            finally:  # also when a reader failed: what was enqueued is waited for next time
                self._used.record(stream)
                self._pending = True


def record(device: torch.device | None) -> torch.cuda.Event | None:
    """An event recorded on the current stream of ``device`` (``None`` without a device): what
    that stream has issued so far, for another thread's stream to wait on."""
    if device is None:
        return None
    return torch.cuda.current_stream(device).record_event()


def stream_for(device: torch.device | None) -> torch.cuda.Stream | None:
    """A new stream on ``device`` (``None`` without a device): a background thread's own."""
    return None if device is None else torch.cuda.Stream(device)


def on(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    """Make ``stream`` current (and its device) for the block; nothing when ``None``."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


class WorkerStream:
    """A background thread's CUDA stream, ordered against the streams of the threads it serves.

    With ``device=None`` (no CUDA tier) every method does nothing.

    1. :meth:`hand_over`, on the thread handing work over: the worker's stream waits for
       everything the caller's current stream has issued (e.g. the round's writes into the
       slots the demoter will read).
    2. :meth:`use`, on the worker thread: its copies go to its own stream.
    3. :meth:`finished`, on the worker thread after its copies: an event that
       :meth:`join` waits on.
    4. :meth:`join`, on any thread before it touches what the worker wrote or freed: its current
       stream waits for that event (on the device; the host goes on).

    Args:
        device: the shard's CUDA device, or ``None``.
    """

    def __init__(self, device: torch.device | None) -> None:
        self.device = device
        self.stream = stream_for(device)
        self.event: torch.cuda.Event | None = None  # after the worker's latest copies

    def hand_over(self) -> None:
        """The worker's stream waits for the caller's current stream (call before submitting)."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    @contextlib.contextmanager
    def use(self) -> Iterator[None]:
        """The worker's stream as the current one for the block."""
        with on(self.stream):
            yield

    def finished(self) -> None:
        """Record the end of the worker's copies issued so far (on the worker thread)."""
        if self.stream is not None:
            self.event = self.stream.record_event()

    def join(self) -> None:
        """The caller's current stream waits for the worker's latest copies (from any thread;
        waiting again on an event already waited on costs nothing on the device)."""
        event = self.event
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
