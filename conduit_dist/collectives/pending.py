"""Collectives in flight: what :class:`~conduit_dist.collectives.exchange.Exchange` returns for
a launched all-to-all or all-gather, waited on later with the exchange's timeout."""

from __future__ import annotations

import torch
import torch.distributed as dist


class PendingWork:
    """A collective in flight (see :meth:`Exchange.all_to_all_async`)."""

    def __init__(self, ex, work: dist.Work | None, op: str, round: int, cuda: bool = False):
        self._ex, self._work, self._op, self._round = ex, work, op, round
        self._cuda = cuda
        self._done: object = None  # the work once waited on (its completion time, if it has one)

    def in_flight(self) -> bool:
        """Whether it is still running (never blocks: one query of the work; on the GPU, of
        its event)."""
        work = self._work
        return work is not None and not work.is_completed()

    def wait(self) -> None:
        """Block (with the exchange's timeout) until it completed.

        Raises:
            RoundError: on a timeout or a failed peer, naming the round and the late ranks.
        """
        work, self._work = self._work, None
        if work is not None:  # a second wait keeps the first one's work (its completion time)
            self._done = work
        self._ex._wait(work, self._op, self._round, self._cuda)

    def completed_at(self) -> float | None:
        """Once waited on: when the exchange completed, in ``time.perf_counter`` seconds, where
        its transport says (shared memory: the last rank's arrival); ``None`` elsewhere (gloo
        and NCCL report no completion time)."""
        at = getattr(self._done, "completed_at", None)
        # a float from our transport (a torch Work has none; 0.0: peers built without stamps)
        return at if isinstance(at, float) and at > 0 else None


class PendingGather(PendingWork):
    """An all-gather in flight (see :meth:`Exchange.all_gather_start`)."""

    def __init__(self, ex, work: dist.Work | None, out: torch.Tensor, round: int):
        super().__init__(ex, work, "all_gather(meta)", round)
        self._out = out

    def wait(self) -> torch.Tensor:
        """Block (with the exchange's timeout) until every rank's tensor arrived.

        Returns:
            ``[world, len(local)]``.

        Raises:
            RoundError: on a timeout or a failed peer, naming the round and the late ranks.
        """
        super().wait()
        return self._out
