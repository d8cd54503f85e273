"""Shared benchmark helpers: argument checks, medians of repeated timings, the final JSON line."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
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


# what torchrun sets: stripped for a subprocess that must run as its own world of one
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def run_peer(bench: str, python: str, script: str, cfg: dict, hint: str) -> dict:
    """Run a peer's timing script in its own interpreter (one torch thread, no torchrun
    environment) and return the JSON of its last line.

    Raises:
        SystemExit: naming the bench, if the interpreter is missing (``hint``: how to make it)
            or the script fails (with the end of its stderr).
    """
    if not os.path.exists(python):
        raise SystemExit(f"bench {bench}: the peer's interpreter {python!r} does not exist; {hint}")
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run([python, script, json.dumps(cfg)], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"bench {bench}: the peer failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _commit() -> dict[str, object]:
    """The checkout's commit and whether tracked files differ from it (``None`` outside a git
    checkout, e.g. an installed wheel)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        top = subprocess.run(
            ["git", "-C", root, "rev-parse", "--show-toplevel", "HEAD"],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
        lines = top.stdout.split()
        # the package must be the checkout's own (not a wheel installed inside another tree)
        if (
            top.returncode != 0
            or len(lines) != 2
            or os.path.realpath(lines[0]) != os.path.realpath(root)
        ):
            return {"commit": None, "dirty": None}
        head = lines[1]
        diff = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}
    return {"commit": head, "dirty": bool(diff.stdout.strip())}


def provenance() -> dict[str, object]:
    """What a benchmark's figures depend on beyond its options: the commit (and whether the
    tree was dirty), the package and torch versions, which native functions this process's
    build has (their fast paths are the ones taken; rank 0's, where the bench prints), the
    process group's world size and backend, and the cores this process may run on.

    Returns:
        A JSON-ready dict (``emit`` puts it under ``"provenance"`` in every benchmark's line).
    """
    import platform

    import torch
    import torch.distributed as dist

    from conduit_dist import __version__
    from conduit_dist.records.native import native_state

    up = dist.is_available() and dist.is_initialized()
    return {
        **_commit(),
        "conduit_dist": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "native": native_state(),
        "world_size": dist.get_world_size() if up else int(os.environ.get("WORLD_SIZE", 1)),
        "backend": str(dist.get_backend()) if up else None,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "host": platform.node(),
    }


def emit(name: str, results: list[dict], summary: dict, **extra: object) -> None:
    """Print the benchmark's JSON line (always the last line of output), with its
    :func:`provenance` under ``"provenance"``."""
    line = {"bench": name, **extra, "provenance": provenance(), "results": results}
    print(json.dumps({**line, "summary": summary}), flush=True)


# ---------------------------------------------------------------------------- argument checks
# Used as argparse ``type=``: a bad value fails at parse time, before anything is measured, as
# ``error: argument --out: expected a path ending in .png, got 'x.json'`` (exit status 2).


def check_out_path(path: str, suffixes: Sequence[str]) -> str:
    """``path`` if it ends in one of ``suffixes`` and its directory exists or can be created.

    Nothing is created: the nearest existing ancestor directory must be writable.

    Raises:
        argparse.ArgumentTypeError: naming the expected suffixes or directory, and ``path``.
    """
    if not path.lower().endswith(tuple(s.lower() for s in suffixes)):
        raise argparse.ArgumentTypeError(
            f"expected a path ending in {' or '.join(suffixes)}, got {path!r}"
        )
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(
            f"expected a path under a writable directory, got {path!r} ({parent} is not one)"
        )
    return path


def out_path(*suffixes: str) -> Callable[[str], str]:
    """An argparse ``type=`` for an output file: :func:`check_out_path` with ``suffixes``.

    Example::

        p.add_argument("--out", type=out_path(".png"), default="bench_out/latency.png")
    """

    def parse(text: str) -> str:
        return check_out_path(text, suffixes)

    parse.__name__ = "out_path"  # argparse names the type in some messages
    return parse


def number(
    kind: type[int] | type[float], minimum: float, *, strict: bool = False
) -> Callable[[str], int | float]:
    """An argparse ``type=`` for a finite ``int`` or ``float`` of at least ``minimum`` (above it
    with ``strict``).

    Example::

        p.add_argument("--repeats", type=number(int, 1), default=15)
        p.add_argument("--ratio", type=number(float, 0, strict=True), default=1.0)

    The error reads ``argument --repeats: expected an integer >= 1, got '0'``.
    """
    noun = "an integer" if kind is int else "a finite number"
    expected = f"expected {noun} {'>' if strict else '>='} {minimum:g}"

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{expected}, got {text!r}") from None
        ok = value > minimum if strict else value >= minimum  # False for nan
        if not ok or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{expected}, got {text!r}")
        return value

    parse.__name__ = kind.__name__
    return parse
