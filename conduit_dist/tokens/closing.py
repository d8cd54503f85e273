"""How a token plane ends (``Closing``): the closing round, the group released, and what was
left undelivered counted (docs/tokens.md, "Producers apart from learners").

A clean ``close`` takes a round launched ahead that no take used (its groups are counted, not
delivered: they were taken out of their holders), runs the closing round unless a peer's
already ran, then releases the round thread and the plane's group (a barrier first on a clean
close, so no peer still reads this rank's shared-memory files). ``abort`` (after a failure)
releases the group first, so that a launched round mid-collective fails rather than hangs, and
then abandons the round thread.
"""

from __future__ import annotations

import contextlib
import time

from conduit_dist.tokens.ahead import TakeTiming
from conduit_dist.tokens.round import Request


class Closing:
    """A token plane's close and abort, and the counts of what they left undelivered.

    Args:
        runner: the plane's ``TokenRunner``.
        ex: the plane's ``Exchange``.
        store: this rank's ``GroupStore``.
    """

    def __init__(self, runner, ex, store) -> None:
        self.runner, self.ex, self.store = runner, ex, store
        self.counts = {"groups": 0, "sequences": 0, "launched_groups": 0}

    def close(self, version: int) -> None:
        """The closing round (unless a peer's ran) and the release; ``version``: this rank's."""
        clean = False
        try:
            pending = self.runner.ahead.pending
            if pending is not None:  # launched ahead, never taken
                _, stats = self.runner.take(pending.key, time.perf_counter(), TakeTiming())
                self.counts["launched_groups"] += stats.groups
            if self.runner.closed_by < 0:
                self.runner.run(Request(closing=True), version)
            clean = True
        finally:
            self.counts["groups"] += len(self.store.groups)
            self.counts["sequences"] += self.store.sequences
            self.runner.close()
            with contextlib.suppress(Exception):  # clean: every rank ran the same exchanges,
                self.ex.close(drain=clean)  # so a barrier before its shared-memory files go
            self.runner.weights.close()  # its weights files, once no peer copies from them

    def abort(self) -> None:
        """Release the group without a closing round (the peers' next round then fails naming
        this rank instead of waiting for it), then abandon the round thread."""
        with contextlib.suppress(Exception):
            self.ex.close()
        self.runner.weights.close()
        self.runner.close(wait=False)

    def stats(self) -> dict[str, int]:
        """``left_at_close_groups``/``_sequences`` (still in this rank's store, complete or
        still generating) and ``launched_at_close_groups`` (a launched round no take used)."""
        c = self.counts
        return {
            "left_at_close_groups": c["groups"],
            "left_at_close_sequences": c["sequences"],
            "launched_at_close_groups": c["launched_groups"],
        }
