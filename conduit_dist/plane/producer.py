"""The producer side of :class:`~conduit_dist.plane.DataPlane`: ``put`` and ``staged``.

A mixin over the plane's state (spec, staging double buffer, scheduler, shard, timeline), kept
apart so each file reads at once; :class:`~conduit_dist.plane.core.DataPlane` is the only user.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch

from conduit_dist.errors import ConfigError
from conduit_dist.sched import Timeline
from conduit_dist.sched.scheduler import now


class Producer:
    """``put`` (copying or donating) and ``staged`` (in place) on a :class:`DataPlane`."""

    def put(self, batch: Mapping[str, torch.Tensor], *, donate: bool = False) -> None:
        """Validate a batch and stage it for the next round.

        Args:
            batch: ``name -> tensor [B, *shape]`` matching the spec (any device).
            donate: hand the tensors over instead of copying them now: they are packed by the
                round (in ``overlap`` mode, during backward). Like a buffer given to ``isend``,
                they must not be modified until the next round has completed.

        Raises:
            SpecError: on a missing or extra field, wrong dtype or shape, disagreeing batch sizes,
                an empty batch or non-finite floats; nothing is staged then.
            ConfigError: with ``max_lag=0``, when a round for the next fetch is already in flight
                (the batch would miss this experience).
        """
        self._check_open()
        t0 = now()
        n = self.spec.validate(batch)
        self._check_lag("put")
        rows = None if donate else self._direct_rows(n)
        if donate:  # checked now, packed by the round
            self.spec.check_finite(batch)
            self._stage.current.defer(n, dict(batch))
        elif rows is not None:  # rows count from the next round on: a rejected pack leaves none
            self.spec.pack(batch, rows, check=True)
            self._direct += n
        else:
            stage = self._stage.current
            self.spec.pack(batch, stage.reserve(n), check=True)
            stage.commit(n)
        self._put_seq += 1
        self.timeline.add("put", Timeline.LEARNER, t0, now(), items=n)

    @contextlib.contextmanager
    def staged(self, n: int) -> Iterator[dict[str, torch.Tensor]]:
        """Write ``n`` items straight into the next round's staging: ``put`` without its copy.

        ::

            with plane.staged(n) as batch:  # name -> writable view [n, *shape]
                env.step_into(batch["obs"], ...)  # the producer writes in place
            plane.flush()  # (or fetch) moves them like put's items

        Like ``torch.empty``, the views start uninitialised: write every field of every item.
        They are valid only inside the block. On leaving it, checked floating fields are scanned
        for NaN/inf in place and the items count as put; if the block raises, or the scan finds a
        non-finite value, nothing is staged. No other plane call may run inside the block.

        Args:
            n: items to stage (``>= 1``).

        Yields:
            ``name -> tensor [n, *shape]`` views into host staging rows (rows keep the record
            stride).

        Raises:
            ConfigError: for ``n < 1``, a block inside another, or with ``max_lag=0`` when the
                round for the next fetch was launched already.
            SpecError: on leaving the block, naming a checked floating field that holds NaN/inf.
        """
        self._check_open()
        if not isinstance(n, int) or n < 1:
            raise ConfigError(f"staged: n must be an int >= 1, got {n!r}")
        self._check_lag("staged")
        t0 = now()
        stage = self._stage.current
        rows = stage.reserve(n)
        self._in_staged = True
        try:
            yield self.spec.unpack(rows)
            self.spec.check_records_finite(rows)
            stage.commit(n)
        finally:
            self._in_staged = False
        self._put_seq += 1
        self.timeline.add("put", Timeline.LEARNER, t0, now(), items=n)

    def _check_lag(self, op: str) -> None:
        pending = self._sched.pending
        if self.max_lag == 0 and pending is not None and pending.kind == "prefetch":
            raise ConfigError(
                f"{op}: max_lag=0, but the round for the next fetch was launched already "
                "(fetch(..., more=True)); put before the first fetch of an iteration"
            )

    def _direct_rows(self, n: int) -> torch.Tensor | None:
        """At world size 1, the storage slots the next ``n`` items take, if writing there is safe.

        Safe when no round is in flight (nothing samples meanwhile), nothing is staged yet this
        round (put order is kept) and the slots do not wrap. The slots count at the next round;
        until then they are invisible, as staged items are.
        """
        if self.world != 1 or self._sched.pending is not None or self._stage.current.count:
            return None
        return self.shard.direct_region(self._direct, n)
