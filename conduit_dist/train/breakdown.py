"""Where an iteration's time goes: wall laps of the loop's parts, CPU per thread, idle.

The trainer calls :meth:`Breakdown.begin` at the top of an iteration, :meth:`Breakdown.lap` after
each part (the wall time since the previous lap goes to that part) and :meth:`Breakdown.end` at
the bottom. CPU comes from the clocks, never from wall time:

- ``cpu``: ``time.process_time`` over the iteration (every thread of the process: the loop, the
  round worker, gloo's and DDP's threads);
- ``main_cpu``: ``time.thread_time`` of the loop's thread; ``idle`` = wall - ``main_cpu``, the time
  the loop's thread was off the CPU (blocked on a collective, or preempted);
- ``round_cpu``: the rounds' own ``thread_time`` (``RoundStats.cpu_ms``, on whichever thread ran
  them), added with :meth:`add`; ``ddp``: the wall time of DDP's gradient collectives
  (``GradSync``).

Averages are per iteration over the iterations recorded (``means``).
"""

from __future__ import annotations

import time

PARTS = (
    "act",  # the policy's forward for the actions
    "env",  # stepping the environments
    "put",  # plane.put
    "exposed",  # the learner's wait in fetch (or an actor's flush)
    "forward",  # the loss's forward
    "backward",  # loss.backward (includes DDP's exposed all-reduce)
    "optimizer",  # clipping, the optimizer step, the target update
    "publish",  # weights published or pulled (disaggregated)
    "ddp",  # DDP's gradient collectives, launch to completion (overlaps backward)
    "round_cpu",  # the rounds' CPU time (the thread that ran them)
    "cpu",  # CPU of every thread of the process
    "main_cpu",  # CPU of the loop's thread
    "idle",  # wall - main_cpu
    "iteration",  # wall
)


class Breakdown:
    """Per-iteration milliseconds of each of :data:`PARTS`, summed until :meth:`reset`."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget everything recorded."""
        self.sums = dict.fromkeys(PARTS, 0.0)
        self.iterations = 0
        self._last = self._wall0 = self._cpu0 = self._main0 = 0.0

    def begin(self) -> None:
        """Start an iteration."""
        self._last = self._wall0 = time.perf_counter()
        self._cpu0, self._main0 = time.process_time(), time.thread_time()

    def lap(self, part: str) -> None:
        """Charge the wall time since the previous lap (or :meth:`begin`) to ``part``."""
        t = time.perf_counter()
        self.sums[part] += (t - self._last) * 1e3
        self._last = t

    def add(self, part: str, ms: float) -> None:
        """Add milliseconds measured elsewhere (``round_cpu``, ``ddp``)."""
        self.sums[part] += ms

    def end(self) -> float:
        """Close the iteration; returns its wall milliseconds."""
        wall = (time.perf_counter() - self._wall0) * 1e3
        main = (time.thread_time() - self._main0) * 1e3
        self.sums["iteration"] += wall
        self.sums["cpu"] += (time.process_time() - self._cpu0) * 1e3
        self.sums["main_cpu"] += main
        self.sums["idle"] += max(wall - main, 0.0)
        self.iterations += 1
        return wall

    def means(self) -> dict[str, float]:
        """Milliseconds per iteration of each part (zeros before any iteration)."""
        n = max(self.iterations, 1)
        return {p: v / n for p, v in self.sums.items()}

    def merge(self, other: Breakdown) -> None:
        """Add ``other``'s sums and iterations to this one."""
        for p, v in other.sums.items():
            self.sums[p] += v
        self.iterations += other.iterations
