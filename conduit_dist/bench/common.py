"""Shared benchmark helpers: medians of repeated timings, the final JSON line."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

K = TypeVar("K")


def _block(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def median_times(
    fns: Mapping[K, Callable[[], object]], min_time: float = 0.2, repeats: int = 5
) -> dict[K, float]:
    """Median seconds per call of each function over ``repeats`` timed blocks of ~``min_time``.

    The blocks are interleaved (A B C A B C ...), so the machine's drift over time hits every
    function alike instead of whichever ran during a slow stretch.
    """
    calls = {}
    for key, fn in fns.items():
        fn()  # warm-up, then size a block to about min_time
        calls[key] = max(1, int(min_time / max(_block(fn, 1), 1e-7)))
    samples: dict[K, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            samples[key].append(_block(fn, calls[key]))
    return {k: statistics.median(v) for k, v in samples.items()}


def emit(name: str, results: list[dict], summary: dict, **extra: object) -> None:
    """Print the benchmark's JSON line (always the last line of output)."""
    print(json.dumps({"bench": name, **extra, "results": results, "summary": summary}), flush=True)
