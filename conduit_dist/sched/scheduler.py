"""When rounds run: inline (``sync``) or on a worker thread launched at backward (``overlap``).

Rounds run one at a time, in the same order on every rank. In ``overlap`` mode a single worker
thread executes them: gloo moves the bytes on its own threads, and on CUDA the round runs on a side
stream whose completion is published as an event the consumer's stream waits on, with no host
sync. The worker thread's current CUDA device is set to the plane's (the current device is per
thread). Where a plane's rows or payload go by NCCL, every round runs on that one thread, ``sync``
rounds too (the caller waits for it): one thread enqueues the plane's NCCL work.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

import torch

from conduit_dist.errors import RoundError
from conduit_dist.flow.weights import WeightsState
from conduit_dist.rounds.engine import RoundEngine
from conduit_dist.rounds.tickets import RoundStats, RoundTicket
from conduit_dist.threads import executor

MODES = ("overlap", "sync")


@dataclass
class Pending:
    """A round launched before the call it belongs to.

    Attributes:
        kind: ``prefetch`` (launched at backward; it is the next fetch's or flush's round) or
            ``flush`` (launched by an overlapped flush; it is that flush's round).
        ticket: what the round moves.
        future: the worker's result.
        put_seq: this rank's put counter when the round was prepared.
    """

    kind: str
    ticket: RoundTicket
    future: Future
    put_seq: int


class Scheduler:
    """Executes rounds inline or on the plane's round thread.

    Args:
        mode: ``overlap`` or ``sync``.
        engine: runs one round.
        weights: the plane's weights state (broadcast within rounds).
        device: the plane's device (CUDA gets a side stream and events).
        timeout_s: the collectives' timeout; a launched round that has not finished in
            ``4 * timeout_s`` fails.
        round_thread: every round runs on the round thread, in both modes (a plane whose rows
            or payload go by NCCL: one thread enqueues its NCCL work, ``DevicePlan``).

    On CUDA a round runs on a side stream, after the consumer's stream only where it reads what
    that stream wrote (``RoundTicket.ready``); it ends with an event the consumer's stream waits
    on (:meth:`_adopt`), and nothing waits for it on the host: a staging buffer the round read
    is written again once that event has passed (``RecordBuffer.read_event``), a delivery
    buffer once the consumer released it (``OutputPool.release_point``).
    """

    def __init__(
        self,
        mode: str,
        engine: RoundEngine,
        weights: WeightsState,
        device: torch.device,
        timeout_s: float,
        round_thread: bool = False,
    ) -> None:
        self.mode = mode
        self.engine, self.weights = engine, weights
        self.timeout_s = timeout_s
        self.round_thread = round_thread
        self.pending: Pending | None = None
        cuda = device.type == "cuda"  # resolved once by the build: cuda:<index>
        threaded = mode == "overlap" or round_thread
        self._pool = executor("conduit-round", device) if threaded else None
        self._stream = torch.cuda.Stream(device) if cuda else None
        self._device = device
        self._last: Future | None = None  # the latest launched round (maybe timed out in wait)
        # CUDA: the event that ends the latest round's device work (set on the round's thread)
        self.last_event = None
        # the consumer's stream touched the storage outside a round (a state dict, a
        # checkpoint's snapshot, a restore): the next round's side stream waits for it
        self.touched = False

    def _execute(self, ticket: RoundTicket):
        return self._on_stream(ticket, lambda: self.engine.run(ticket, self.weights))

    def _on_stream(self, ticket: RoundTicket, run):
        """``run()`` (a round, or a started round's finish) on the side stream, after the
        ticket's event; returns ``(out, stats, event)`` without waiting for the device."""
        try:
            if self._stream is None:
                out, stats = run()
                return out, stats, None
            with torch.cuda.stream(self._stream):
                if ticket.ready is not None:  # it reads what the consumer's stream wrote
                    self._stream.wait_event(ticket.ready)
                out, stats = run()
                event = self._stream.record_event()
            self.last_event = event
            for buf in ticket.buffers():  # written again by put once the round's copies ran
                buf.read_event = event
            return out, stats, event
        finally:
            if ticket.enqueued is not None:  # also when it failed: the hook must not wait on
                ticket.enqueued.set()

    def _adopt(self, out: torch.Tensor, event) -> torch.Tensor:
        """Make ``out`` (produced on the side stream) safe to use on the current stream: that
        stream waits for the round's event (on the device; the host goes on)."""
        if event is not None:
            current = torch.cuda.current_stream(out.device)
            current.wait_event(event)
            out.record_stream(current)
        return out

    def join(self) -> None:
        """CUDA: the current stream waits (on the device) for the latest round's device work,
        before the caller touches the storage outside a round (its copies into the tiers ran on
        the side stream, and no round waits for them on the host); then :attr:`touched` makes
        the next round's side stream wait for what the caller did. Call once no round runs."""
        self.touched = True
        event = self.last_event
        if event is not None:
            torch.cuda.current_stream(self._device).wait_event(event)

    def run(self, ticket: RoundTicket) -> tuple[torch.Tensor, RoundStats]:
        """Run a round now: inline, or on the round thread (waiting for it)."""
        if self.round_thread:
            future = self._last = self._pool.submit(self._execute, ticket)
            out, stats, event = self._result(future, ticket)
        else:
            out, stats, event = self._execute(ticket)
        return self._adopt(out, event), stats

    def _result(self, future: Future, ticket: RoundTicket):
        """A round's ``(out, stats, event)`` from the round thread, within ``4 * timeout_s``.

        Raises:
            RoundError: if it did not finish in time (its own failure propagates as raised).
        """
        try:
            out, stats, event = future.result(timeout=4 * self.timeout_s)
        except FutureTimeout:
            raise RoundError(
                f"round {ticket.round}: not finished after {4 * self.timeout_s:.0f}s",
                round=ticket.round,
            ) from None
        stats.gate_ms = ticket.gate_ms
        return out, stats, event

    def start(self, ticket: RoundTicket, kind: str, put_seq: int) -> None:
        """Run a one-exchange round up to its exchange on this thread and leave it in flight
        (``RoundEngine.start``); the call that owns it finishes it, on its own thread."""
        if self.pending is not None:
            raise RuntimeError("start: one launched round at a time")
        if self.round_thread:  # the whole round on the round thread, in flight until its call
            self.launch(ticket, kind, put_seq)
            return
        if self._stream is None:
            finish = self.engine.start(ticket, self.weights)  # host work: headers, gloo
        else:  # CUDA: on the side stream too, where the finish reads what this half wrote
            # (the local ingest's copies into a device tier, from pinned staging that put
            # reuses once the finish's event has passed); on the consumer's stream neither
            # the finish's gathers nor that event would be ordered after them
            with torch.cuda.stream(self._stream):
                if ticket.ready is not None:
                    self._stream.wait_event(ticket.ready)
                finish = self.engine.start(ticket, self.weights)
        self.pending = Pending(
            kind, ticket, _Started(lambda: self._on_stream(ticket, finish), finish.poll), put_seq
        )

    def poll(self) -> None:
        """Note whether a started round's exchange is still running (``RoundEngine.start``;
        one query of the work, never blocking); nothing for a round launched on the worker."""
        p = self.pending
        if p is not None and isinstance(p.future, _Started):
            p.future.poll()

    def launch(self, ticket: RoundTicket, kind: str, put_seq: int) -> None:
        """Start a round on the worker thread (``overlap`` mode only; one at a time)."""
        if self._pool is None or self.pending is not None:
            raise RuntimeError("launch: one launched round at a time, in overlap mode only")
        self._last = self._pool.submit(self._execute, ticket)
        self.pending = Pending(kind, ticket, self._last, put_seq)

    def gate(self, ticket: RoundTicket) -> None:
        """Wait until a launched round's NCCL work is enqueued (or the round ended): called by
        the call that launched it (a backward hook, ``fetch_start``, an overlapped ``flush``),
        so that on every rank the plane's NCCL calls come before whatever NCCL work the caller
        issues next (DDP's in the backward), the order NCCL needs between two communicators.

        Raises:
            RoundError: if the round is neither enqueued nor ended after ``4 * timeout_s``.
        """
        t0 = time.perf_counter()
        future = self.pending.future if self.pending is not None else None
        while not ticket.enqueued.wait(0.05):
            if future is not None and future.done():  # ended before enqueueing (it failed)
                break
            if time.perf_counter() - t0 > 4 * self.timeout_s:
                raise RoundError(
                    f"round {ticket.round}: its NCCL work was not enqueued after "
                    f"{4 * self.timeout_s:.0f}s",
                    round=ticket.round,
                )
        ticket.gate_ms = (time.perf_counter() - t0) * 1e3

    def wait(self) -> tuple[Pending, torch.Tensor, RoundStats]:
        """Wait for the launched round and clear it.

        Raises:
            RoundError: if the round failed, or did not finish within ``4 * timeout_s``.
        """
        p, self.pending = self.pending, None
        assert p is not None
        out, stats, event = self._result(p.future, p.ticket)
        return p, self._adopt(out, event), stats

    def drain(self) -> None:
        """Finish a launched round, if any (its delivered batch is dropped)."""
        if self.pending is not None:
            self.wait()

    def settle(self, timeout_s: float | None = None) -> None:
        """Block until no round is running; a launched round stays pending for its call.

        Nothing is raised or swallowed here: a failed round raises at :meth:`wait`, from the
        call it belongs to.
        """
        if self.pending is not None:
            future = self.pending.future
            if isinstance(future, _Started):  # nothing runs it but the caller: finish it now
                future.finish()
                return
            wait_futures([future], timeout=timeout_s or 4 * self.timeout_s)

    def close(self, abandon: bool = False) -> bool:
        """Stop the worker after draining; returns whether it has stopped.

        ``abandon`` (after a failure): the launched round's result is dropped, but the worker is
        given up to ``2 * timeout_s`` to leave it (its collectives time out by then), so the
        caller never frees the group or the shard under a running round. ``False``: it is still
        inside the round; the caller must leave those resources alone.
        """
        if abandon:
            self.pending, last = None, self._last
            if last is not None:
                wait_futures([last], timeout=2 * self.timeout_s)
                if not last.done():
                    self._pool.shutdown(wait=False)
                    return False
        try:
            self.drain()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
        return True


class _Started:
    """A round started on the caller's thread, with the part of ``Future``'s surface the
    scheduler and the controller use; :meth:`result` finishes it on the calling thread (once).
    """

    def __init__(self, finish, poll) -> None:
        self._finish, self._poll = finish, poll
        self._result = None
        self._error: BaseException | None = None
        self._done = False

    def finish(self) -> None:
        """Wait for the exchange and finish the round (keeping its result or its error)."""
        if self._done:
            return
        self._done = True
        try:
            self._result = self._finish()
        except BaseException as exc:
            self._error = exc

    def poll(self) -> None:
        """Note the time if its exchange is still running (until it is finished)."""
        if not self._done:
            self._poll()

    def done(self) -> bool:
        """Whether it was finished."""
        return self._done

    def exception(self) -> BaseException | None:
        """Its error, if finishing it failed."""
        return self._error

    def result(self, timeout: float | None = None):
        """``(out, stats, event)``, finishing it first; raises its error (the exchange itself
        waits with the plane's timeout, so ``timeout`` is not needed)."""
        self.finish()
        if self._error is not None:
            raise self._error
        return self._result


def now() -> float:
    """The clock used for spans (``time.perf_counter``)."""
    return time.perf_counter()
