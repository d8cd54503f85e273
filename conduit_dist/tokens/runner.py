"""Where and when a token plane's rounds run, and what they leave the plane (``TokenRunner``).

- **Inline or on the round thread.** A round runs on the calling thread, except: a round
  launched ahead (``fetch_start``, ``attach``: ``tokens/ahead.py``) runs on the plane's round
  thread; and on a CUDA plane (or its rehearsal) *every* round does, the caller waiting for the
  inline ones, so one thread enqueues the plane's NCCL work. A round launched at a backward on
  such a plane holds the backward hook until its sections' exchange is enqueued (the gate), so
  the plane's NCCL calls precede the backward's own (DDP's) on every rank.
- **Streams.** On CUDA a round runs on a side stream: it first waits for an event recorded on
  the caller's stream when it was started (the puts that wrote the arenas), and ends with an
  event the caller's stream waits on before the micro-batches are handed out (``record_stream``
  marks them used there). A ``put`` waits on the device for the latest round's event before it
  writes the arenas again (a compaction could move tokens over a section still being packed);
  the thread that ran the round sets that event before the round's result is available, so a
  round that ended and is not yet taken counts. Nothing waits on the host for a round's device
  work (a put or ``reserve`` while a launched round runs waits for its host side to end: the
  store is the round's until then).
- **Counters.** Each finished round's effects (the newest version, the closing rank, totals)
  are applied on the caller's thread when it takes the round; priority updates go to the engine
  there too, while no round runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from conduit_dist.errors import RoundError
from conduit_dist.tokens.ahead import Ahead, Key, TakeTiming
from conduit_dist.tokens.batch import MicroBatch
from conduit_dist.tokens.round import Request, TokenRound, TokenRoundStats

Result = tuple[list[MicroBatch], TokenRoundStats]


class TokenRunner:
    """Runs one token plane's rounds (see the module docstring).

    Args:
        engine: the round.
        weights: the plane's ``WeightsState``.
        device: the plane's device (CUDA: a side stream and events).
        timeout_s: the collectives' timeout (launched rounds, the gate).
        one_thread: every round on the round thread (a CUDA plane, or its rehearsal).
    """

    def __init__(
        self, engine: TokenRound, weights, device: torch.device, timeout_s: float, one_thread: bool
    ) -> None:
        self.engine, self.weights = engine, weights
        self.ahead = Ahead(device, timeout_s, self._where)
        self.one_thread = one_thread
        self.cuda = device if device.type == "cuda" else None
        self.stream = torch.cuda.Stream(device) if self.cuda is not None else None
        # CUDA: the latest round's end on its side stream (set by the thread that ran it,
        # before its result is available; read by puts once no round runs)
        self.last_event = None
        self.priorities: list[tuple[list[int], list[int], list[float]]] = []
        self.newest, self.closed_by = 0, -1
        self.last: TokenRoundStats | None = None
        self.totals = {"delivered_groups": 0, "wire_bytes": 0, "token_bytes": 0, "rounds": 0}
        self.drain: Callable[[], int] | None = None  # an open ingress's, before every round

    # ------------------------------------------------------------------ running

    def run(self, req: Request, version: int, lazy: bool = False) -> Result:
        """Run a round now (inline, or on the round thread, waiting for it), its effects
        applied and its micro-batches ready on the caller's stream. ``lazy``: a lazily
        published version is packed by this round as it sends it (the caller's module
        cannot change before it returns: ``publish_weights(send_now=True)``).

        Raises:
            RoundError: once a rank closed the plane, or when the round fails.
        """
        if self.closed_by >= 0:
            raise RoundError(
                f"token plane: rank {self.closed_by} closed it; no further round",
                round=self.engine.round,
            )
        if self.drain is not None:  # attached producers' puts join this round
            self.drain()
        body = self._body(req, version, self.weights.snapshot(lazy), False, None)
        if not self.one_thread:
            return self._taken(*body())
        self.ahead.launch(("now",), body)
        return self._taken(*self.ahead.wait()[0])

    def launch(self, key: Key, req: Request, version: int, ahead: bool, gate: bool) -> None:
        """Launch a round on the round thread for the take ``key``; ``gate``: return only once
        its sections' exchange is enqueued (or it ended).

        Raises:
            RoundError: if the gate waited ``4 * timeout_s`` in vain.
        """
        if self.drain is not None:  # attached producers' puts join this round
            self.drain()
        enqueued = threading.Event() if gate else None
        self.ahead.launch(key, self._body(req, version, self.weights.snapshot(), ahead, enqueued))
        if enqueued is None:
            return
        t0, future = time.perf_counter(), self.ahead.pending.future
        while not enqueued.wait(0.05):
            if future.done():
                return
            if time.perf_counter() - t0 > 4 * self.ahead.timeout_s:
                raise RoundError(
                    "token plane: a round launched at the backward did not enqueue its "
                    f"exchange in {4 * self.ahead.timeout_s:.0f}s",
                    round=self.engine.round,
                )

    def take(self, key: Key, asked: float, timing: TakeTiming) -> Result | None:
        """The round launched for ``key``, if one was (see ``Ahead.take``), its effects applied
        and its micro-batches ready on the caller's stream."""
        got = self.ahead.take(key, asked, timing)
        return None if got is None else self._taken(*got)

    def settle(self) -> None:
        """Wait until a round launched ahead has ended (its result stays for its take).

        Raises:
            RoundError: if it has not after ``4 * timeout_s`` (the plane is then failed).
        """
        self.ahead.settle()

    def _where(self) -> tuple[int, tuple[int, ...]]:
        """The round the engine is in and the ranks whose heartbeat is older (for errors)."""
        r = self.engine.round
        try:
            return r, self.engine.ex.laggards(r)
        except Exception:  # the store may be gone with the failure
            return r, ()

    def before_write(self) -> None:
        """CUDA: the caller's stream waits (on the device) for the latest round, before the
        arenas are written again."""
        if self.last_event is not None:
            torch.cuda.current_stream(self.cuda).wait_event(self.last_event)

    def _body(self, req: Request, version: int, snap, ahead: bool, enqueued) -> Callable:
        """The function that runs the round on whichever thread: ``(out, stats, event)``."""
        ready = None
        if self.cuda is not None:  # what the caller's stream wrote (puts) comes first
            ready = torch.cuda.current_stream(self.cuda).record_event()
        self._hand_priorities()

        def body():
            engine = self.engine
            engine.on_enqueued = None if enqueued is None else enqueued.set
            try:
                if self.stream is None:
                    out, stats = engine.run(req, self.weights, version, snap, ahead)
                    return out, stats, None
                with torch.cuda.stream(self.stream):
                    self.stream.wait_event(ready)
                    out, stats = engine.run(req, self.weights, version, snap, ahead)
                    end = self.stream.record_event()
                # before the result is: a put after settle() (the round ended, not yet taken)
                # orders its writes after the round's packing reads of the arenas
                self.last_event = end
                return out, stats, end
            finally:
                engine.on_enqueued = None
                if enqueued is not None:
                    enqueued.set()

        return body

    def _taken(self, out: list[MicroBatch], stats: TokenRoundStats, event=None) -> Result:
        """A finished round, on the caller's thread: its micro-batches ordered after it on the
        caller's stream, and its effects on the counters."""
        if event is not None:  # CUDA only
            current = torch.cuda.current_stream(self.cuda)
            current.wait_event(event)
            for mb in out:
                for t in (*mb.fields.values(), mb.cu_seqlens):
                    if t.is_cuda:
                        t.record_stream(current)
        self.newest, self.last = stats.newest, stats
        if stats.closing_rank >= 0:
            self.closed_by = stats.closing_rank
        t = self.totals
        t["delivered_groups"] += stats.groups
        t["wire_bytes"] += stats.wire_bytes
        t["token_bytes"] += stats.token_bytes
        t["rounds"] += 1
        return out, stats

    # ------------------------------------------------------------------ priorities

    def queue_priorities(self, holder: list[int], gid: list[int], pr: list[float]) -> None:
        """Priorities for the next round (handed to the engine when a round starts)."""
        self.priorities.append((holder, gid, pr))

    def _hand_priorities(self) -> None:
        """The priorities given since the last round, to the engine (on the caller's thread,
        while no round runs: the round reads them on whichever thread runs it)."""
        for holder, gid, pr in self.priorities:
            self.engine.queue_priorities(holder, gid, pr)
        self.priorities = []

    def close(self, wait: bool = True) -> None:
        """Stop the round thread (a launched round is waited for by the caller first;
        ``wait=False``: after a failure, not waited for at all)."""
        self.ahead.close(wait)
