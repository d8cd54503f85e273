"""Overlap glue of :class:`~conduit_dist.plane.DataPlane`: launching rounds at backward.

A mixin over the plane's state (scheduler, timeline, auto trial, fetch bookkeeping), kept apart so
each file reads at once; :class:`~conduit_dist.plane.core.DataPlane` is the only user.
"""

from __future__ import annotations

import logging

from torch import nn

from conduit_dist.errors import ConfigError
from conduit_dist.sched import BackwardTrigger, Timeline
from conduit_dist.sched.scheduler import now

log = logging.getLogger("conduit_dist")


class Overlap:
    """``attach``/``detach`` a learner module, launch at its backward, follow the auto trial."""

    @property
    def chosen_schedule(self) -> str:
        """The schedule in force on this rank (``auto``: the trial's pick once it is over)."""
        if self._trial is not None and self._trial.choice is None:
            return "auto (trial)"
        return "overlap" if self._overlap else "sync"

    def _auto_tick(self, t: float) -> None:
        """Feed the auto trial the iteration that ended at this fetch; follow its mode."""
        mode = self._trial.tick(t, "overlap" if self._overlap else "sync")
        if mode is not None:
            self._overlap = mode == "overlap"
            if self._trial.choice is not None:
                log.info("rank %d: %s", self.rank, self._trial.describe())

    def attach(self, module: nn.Module) -> None:
        """Launch the next fetch's round when ``module``'s backward starts (``overlap`` mode).

        Args:
            module: the learner's module, plain or DDP-wrapped. Only forwards whose outputs
                require grad count; several backward passes per fetch launch one round.

        Raises:
            ConfigError: if a module is attached already.
        """
        if self._trigger is not None and self._trigger.attached:
            raise ConfigError("attach: a module is attached already; call detach() first")

        def forward_span(start: float, end: float) -> None:
            self.timeline.add("forward", Timeline.LEARNER, start, end)

        self._trigger = BackwardTrigger(module, self._on_backward, forward_span)

    def detach(self) -> None:
        """Remove the hooks (a launched round still completes at the next call)."""
        if self._trigger is not None:
            self._trigger.remove()
            self._trigger = None

    def _on_backward(self) -> None:
        t = now()
        self.timeline.add("backward start", Timeline.LEARNER, t, t)
        if not self._overlap or self._closed or self._failed is not None:
            return
        if self._in_staged:  # a launch would take the staging buffer under the open block
            return
        if self._sched.pending is not None or not self._fetched:
            return
        if self.max_lag == 0 and not self._more:
            return
        self._fetched = False
        self._sched.launch(self._prepare(self._last_batch), "prefetch", self._put_seq)
