"""``python -m conduit_dist.bench sequences``: slice sampling cost against the store's size.

conduit: a world-size-1 ``DataPlane`` with ``cd.Prioritized(alpha=0, sequence=cd.Windows(
length=T, stream="env"))`` (uniform over valid starts), filled with a small transition (4
observation floats, action, reward, done, env) from 8 interleaved streams (a vector env's puts,
episodes of ``T`` to ``4 * episode`` steps), then ``fetch(B)`` timed: ``B`` slices ``[B, T, ...]``
that never cross an episode end. Sizes 10k, 1M and 10M stored items by default; the ratio of the
largest to the smallest is what must stay flat.

Beside it, in its own interpreter (``--peer-python``, see ``scripts/peer_env.sh``), TorchRL's
``ReplayBuffer(LazyTensorStorage(N), SliceSampler(slice_len=T, traj_key="episode"))`` with the
same sizes, episodes stored back to back (its layout; interleaved streams would make every item
its own trajectory), ``sample()`` of ``B * T`` items, default options (``cache_values`` off: the
storage changes between samples in training). The two alternate size by size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import conduit_dist as cd
from conduit_dist.bench.common import emit, number, run_peer

PEER = os.path.join(os.path.dirname(__file__), "sequences_peer.py")
STREAMS = 8


def _fill(plane: cd.DataPlane, n: int, t_len: int, episode: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    steps = -(-n // STREAMS)
    left = torch.randint(t_len, 4 * episode, (STREAMS,), generator=g)
    chunk = max(1, 65536 // STREAMS)
    for at in range(0, steps, chunk):
        k = min(chunk, steps - at)
        # episode ends per stream over the chunk's steps
        done = torch.zeros(k, STREAMS, dtype=torch.bool)
        for e in range(STREAMS):
            pos, ends = int(left[e]), []
            while pos <= k:
                ends.append(pos - 1)
                pos += int(torch.randint(t_len, 4 * episode, (1,), generator=g))
            done[ends, e] = True
            left[e] = pos - k
        batch = {
            "obs": torch.randn(k * STREAMS, 4, generator=g),
            "action": torch.randint(0, 2, (k * STREAMS,), generator=g),
            "reward": torch.randn(k * STREAMS, generator=g),
            "done": done.reshape(-1),
            "env": torch.arange(STREAMS).repeat(k),
        }
        plane.put(batch)
        plane.flush()


def _ours(n: int, a: argparse.Namespace) -> float:
    example = {
        "obs": torch.zeros(1, 4), "action": torch.zeros(1, dtype=torch.int64),
        "reward": torch.zeros(1), "done": torch.zeros(1, dtype=torch.bool),
        "env": torch.zeros(1, dtype=torch.int64),
    }  # fmt: skip
    seq = cd.Windows(length=a.length, stream="env")
    plane = cd.DataPlane(
        cd.ExperienceSpec.from_batch(example), n, schedule="sync",
        sampler=cd.Prioritized(alpha=0.0, beta=0.0, eps=0.0, sequence=seq),
    )  # fmt: skip
    try:
        _fill(plane, n, a.length, a.episode, seed=n)
        for _ in range(5):
            plane.fetch(a.slices)
        times = []
        for _ in range(a.repeats):
            k, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < a.min_time or k < 2:
                b = plane.fetch(a.slices)
                k += 1
            times.append((time.perf_counter() - t0) / k)
        assert b["obs"].shape == (a.slices, a.length, 4)
        return statistics.median(times)
    finally:
        plane.close()


def _peer(n: int, a: argparse.Namespace) -> float:
    cfg = {
        "sizes": [n], "slices": a.slices, "length": a.length, "episode": a.episode, "obs": 4,
        "repeats": a.repeats, "min_time": a.min_time, "threads": 1,
    }  # fmt: skip
    hint = "create it with scripts/peer_env.sh or pass --no-peer"
    return run_peer("sequences", a.peer_python, PEER, cfg, hint)[str(n)]


def main(argv: list[str] | None = None) -> None:
    """Time slice sampling at each size, ours and the peer's, and print the ratios."""
    p = argparse.ArgumentParser(prog="python -m conduit_dist.bench sequences", description=__doc__)
    p.add_argument(
        "--sizes", type=number(int, 1), nargs="+", default=[10_000, 1_000_000, 10_000_000]
    )
    p.add_argument("--slices", type=number(int, 1), default=256, help="B")
    p.add_argument("--length", type=number(int, 2), default=16, help="T")
    p.add_argument("--episode", type=number(int, 1), default=200, help="mean-ish episode length")
    p.add_argument("--repeats", type=number(int, 1), default=5)
    p.add_argument("--min-time", type=float, default=0.5)
    p.add_argument("--peer-python", default=os.path.join(".venv-peer", "bin", "python"))
    p.add_argument("--no-peer", action="store_true", help="time conduit only")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    cd.init_distributed()
    results = []
    for n in a.sizes:
        row = {"stored": n, "conduit_ms": _ours(n, a) * 1e3}
        if not a.no_peer:
            row["torchrl_ms"] = _peer(n, a) * 1e3
            row["speedup_vs_torchrl"] = row["torchrl_ms"] / row["conduit_ms"]
        results.append(row)
        print(json.dumps(row), flush=True)
    lo, hi = results[0], results[-1]
    summary = {"conduit_largest_vs_smallest": hi["conduit_ms"] / lo["conduit_ms"]}
    if not a.no_peer:
        summary["torchrl_largest_vs_smallest"] = hi["torchrl_ms"] / lo["torchrl_ms"]
        summary["speedup_vs_torchrl_largest"] = hi["speedup_vs_torchrl"]
    emit("sequences", results, summary, slices=a.slices, length=a.length, world=1)


if __name__ == "__main__":
    main()
