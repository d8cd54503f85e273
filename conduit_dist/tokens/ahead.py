"""The token plane's round launched ahead: started at a backward (or by ``fetch_start``) on the
plane's round thread, taken by the next ``fetch``/``stream`` (docs/tokens.md, "Behind the
backward").

A learner's next global batch cannot start before the current one is complete, and its rounds
cannot run until the caller asks: so whatever one takes is exposed. Launched ahead, the next
batch's first round (its table all-gather, selection, plan and the exchange of its sequences)
runs on one worker thread while the caller's backward and optimiser step run; the next ``fetch``
or ``stream`` takes its micro-batches, and waits only for what is left of it (then runs any
further round inline, as before). Every learner launches at the same point of its loop: the
first backward after a ``fetch``/``stream`` has completed (every learner has the same number of
micro-batches), or an explicit ``fetch_start``.

The account of one take (:class:`TakeTiming`): *exposed* is the time the caller waited inside
``fetch``/``stream`` for rounds (a launched round's remainder and the inline rounds, not the
``produce`` callbacks); *hidden* is the part of a launched round that ran before the caller
asked (``sched.timeline.split``), both measured with ``time.perf_counter``.
"""

from __future__ import annotations

import time
from concurrent import futures
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import torch

from conduit_dist.errors import RoundError
from conduit_dist.sched.timeline import split
from conduit_dist.threads import executor

Key = tuple[int, int, bool]  # (num_groups, token_budget, streaming) of the fetch it serves


@dataclass
class TakeTiming:
    """One ``fetch``/``stream`` of a token plane: where the time of its rounds went.

    Attributes:
        rounds: rounds the take used (a launched one included).
        launched: whether its first round was launched ahead.
        exposed_ms: the caller's wait for rounds inside the call (not ``produce``).
        hidden_ms: the launched round's time before the caller asked (behind its backward).
    """

    rounds: int = 0
    launched: bool = False
    exposed_ms: float = 0.0
    hidden_ms: float = 0.0


@dataclass
class _Launched:
    key: Key
    future: Future
    start: float  # perf_counter at launch


class Ahead:
    """The plane's round thread and at most one round on it (launched ahead of the learner's
    next take, or an inline round a CUDA plane runs there).

    Args:
        device: the plane's device (the thread's current CUDA device).
        timeout_s: the collectives' timeout; a round not finished after ``4 * timeout_s``
            fails the call waiting for it, and every later call (it may still be running).
        where: ``() -> (round, ranks)``: the round running and the ranks behind it (errors).
    """

    def __init__(self, device: torch.device, timeout_s: float, where=None) -> None:
        self.device, self.timeout_s = device, timeout_s
        self.where = where  # () -> (round, laggard ranks), for the errors
        self.failed: str | None = None  # a round that outlasted its wait: nothing runs after
        self._pool = None  # made at the first launch: a plane that never launches has none
        self.pending: _Launched | None = None
        self.armed: Key | None = None  # launch this at the next backward (attach)
        self.trigger = None  # the BackwardTrigger of attach()

    def launch(self, key, run) -> None:
        """Start ``run()`` (a round: its result tuple) on the round thread.

        Raises:
            RoundError: once an earlier round outlasted its wait.
        """
        self._check()
        if self.pending is not None:
            raise RuntimeError("token plane: one launched round at a time")
        if self._pool is None:
            self._pool = executor("conduit-tokens", self.device)

        def timed():
            return run(), time.perf_counter()

        # the start read before the submit: the round may end before this thread runs again
        start = time.perf_counter()
        self.pending = _Launched(key, self._pool.submit(timed), start)

    def take(self, key: Key, asked: float, timing: TakeTiming):
        """The result of the round launched for ``key`` (accounted in ``timing``: hidden up to
        ``asked``, the rest exposed); ``None`` when none is pending.

        Raises:
            RuntimeError: if the pending round was launched for another request (callers
                compare keys first).
            RoundError: if it has not finished after ``4 * timeout_s`` (its own failure
                propagates as raised).
        """
        p = self.pending
        if p is None:
            return None
        if p.key != key:
            raise RuntimeError(f"token plane: the round in flight was launched for {p.key}")
        res, end = self.wait()
        now = time.perf_counter()
        _, hidden = split((p.start, end), (asked, now))
        timing.launched, timing.rounds = True, timing.rounds + 1
        timing.hidden_ms += hidden * 1e3
        timing.exposed_ms += (now - asked) * 1e3  # the wait itself, the hand-over included
        return res

    def wait(self):
        """Wait for the pending round and clear it: ``(result, end)`` (``perf_counter``).

        Raises:
            RoundError: if it has not finished after ``4 * timeout_s``; its own failure.
        """
        p, self.pending = self.pending, None
        try:
            return p.future.result(timeout=4 * self.timeout_s)
        except FutureTimeout:
            self._late()

    def settle(self) -> None:
        """Wait until the pending round has ended (its result stays pending).

        Raises:
            RoundError: if it has not after ``4 * timeout_s``.
        """
        self._check()
        p = self.pending
        if p is not None:
            done, _ = futures.wait([p.future], timeout=4 * self.timeout_s)
            if not done:
                self.pending = None
                self._late()

    def _check(self) -> None:
        if self.failed is not None:
            raise RoundError(f"token plane: {self.failed}; no further round on this rank", round=-1)

    def _late(self):
        """A round outlasted its wait: it may still be running (and change the store), so the
        plane is failed for every later call."""
        round, late = self.where() if self.where is not None else (-1, ())
        behind = f"; ranks behind it: {list(late)}" if late else ""
        self.failed = (
            f"round {round} on the round thread has not finished after "
            f"{4 * self.timeout_s:.0f}s (4 x the collectives' timeout){behind}"
        )
        raise RoundError(f"token plane: {self.failed}", round=round)

    def close(self, wait: bool = True) -> None:
        """Stop the round thread and remove the backward hooks (a pending round is waited for
        by the caller first; ``wait=False``: a failed plane's is abandoned, its queue
        cancelled)."""
        if self.trigger is not None:
            self.trigger.remove()
            self.trigger = None
        if self._pool is not None:
            self._pool.shutdown(wait=wait, cancel_futures=not wait)
            self._pool = None
