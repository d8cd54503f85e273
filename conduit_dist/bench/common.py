"""Shared benchmark helpers: medians of repeated timings, the final JSON line."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable


def median_time(fn: Callable[[], object], min_time: float = 0.2, repeats: int = 5) -> float:
    """Median seconds per call of ``fn`` over ``repeats`` timed blocks of at least ``min_time``."""
    fn()  # warm-up
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    calls = max(1, int(min_time / once))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def emit(name: str, results: list[dict], summary: dict, **extra: object) -> None:
    """Print the benchmark's JSON line (always the last line of output)."""
    print(json.dumps({"bench": name, **extra, "results": results, "summary": summary}), flush=True)
