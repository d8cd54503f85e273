"""Step-phase scheduling: launch rounds at backward start, account exposed vs hidden time."""

from conduit_dist.sched.hooks import BackwardTrigger
from conduit_dist.sched.timeline import PHASES, FetchTiming, Timeline, fetch_timing, split

__all__ = ["PHASES", "BackwardTrigger", "FetchTiming", "Timeline", "fetch_timing", "split"]
