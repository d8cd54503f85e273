"""Streams of items whose every field is a function of (rank, env, t), and the single-process
references the support-matrix test checks a plane's batches against."""

from __future__ import annotations

import math
import random

import torch

import conduit_dist as cd

ENVS, GAMMA, N_STEP, LENGTH, BURN_IN = 2, 0.9, 3, 3, 1
FIELDS = {
    "id": ((), torch.int64),
    "env": ((), torch.int64),
    "obs": ((2,), torch.float32),
    "reward": ((), torch.float32),
    "done": ((), torch.bool),
    "truncated": ((), torch.bool),
}
ALPHA, BETA, EPS = 0.7, 0.5, 0.01


def item(rank: int, env: int, t: int) -> int:
    return rank * 100_000 + env * 1_000 + t


def decode(i: int) -> tuple[int, int, int]:
    return i // 100_000, (i // 1_000) % 100, i % 1_000


def ends(i: int) -> tuple[bool, bool]:
    """(done, truncated) of an item: episodes of uneven lengths (~7 steps)."""
    u = random.Random(i * 7919 + 17).random()
    return u < 0.1, 0.1 <= u < 0.15


def step(rank: int, t: int) -> dict[str, torch.Tensor]:
    """One step of this rank's ENVS streams."""
    ids = torch.tensor([item(rank, e, t) for e in range(ENVS)])
    flags = [ends(int(i)) for i in ids]
    return {
        "id": ids,
        "env": torch.arange(ENVS),
        "obs": torch.stack([ids.float() * 0.5, -ids.float()], dim=1),
        "reward": (ids % 97).float() / 10,
        "done": torch.tensor([d for d, _ in flags]),
        "truncated": torch.tensor([tr for _, tr in flags]),
    }


def intact(batch: dict[str, torch.Tensor]) -> bool:
    """Every item field equals what :func:`step` gives for the row's id (any leading shape)."""
    ids = batch["id"]
    return bool(
        torch.equal(batch["obs"][..., 0], ids.float() * 0.5)
        and torch.equal(batch["obs"][..., 1], -ids.float())
        and torch.equal(batch["reward"], (ids % 97).float() / 10)
    )


def prio(ids: torch.Tensor) -> torch.Tensor:
    return 1.0 + (ids % 5).double() * 1.5  # priorities 1 .. 7


def mass(i: int) -> float:
    return (1.0 + (i % 5) * 1.5 + EPS) ** ALPHA


def sampler(kind: str) -> cd.Sampler | str:
    """A fresh sampler of ``kind`` (the support matrix's rows)."""
    seq = dict(stream="env", truncated="truncated", gamma=GAMMA)
    return {
        "uniform": lambda: "uniform",
        "stratified": lambda: "stratified",
        "prioritized": lambda: cd.Prioritized(ALPHA, BETA, EPS, initial_priority=50.0),
        "n_step": lambda: cd.Prioritized(
            ALPHA, BETA, EPS, initial_priority=50.0, sequence=cd.Windows(n_step=N_STEP, **seq)
        ),
        "slices": lambda: cd.Prioritized(
            0.0, 0.0, 0.0, sequence=cd.Windows(length=LENGTH, burn_in=BURN_IN, **seq)
        ),
        "queue": lambda: "queue",
        "lifo": lambda: "lifo",
        "without_replacement": lambda: cd.WithoutReplacement(epochs=2),
    }[kind]()


def nstep_window(i: int, steps: int) -> tuple[int, float, float] | None:
    """(last item, return, discount) of the n-step window from item ``i`` among ``steps``
    stored steps of its stream, or ``None`` when it is not a start (incomplete)."""
    rank, env, t = decode(i)
    ret = 0.0
    for k in range(N_STEP):
        if t + k >= steps:
            return None
        j = item(rank, env, t + k)
        ret += GAMMA**k * (j % 97) / 10
        done, trunc = ends(j)
        if done or trunc:
            return j, ret, 0.0 if done else GAMMA ** (k + 1)
    return item(rank, env, t + N_STEP - 1), ret, GAMMA**N_STEP


def slice_start(i: int, steps: int) -> bool:
    """Whether item ``i`` starts a complete slice (burn-in included) within one episode."""
    rank, env, t = decode(i)
    window = LENGTH + BURN_IN
    if t + window > steps:
        return False
    return not any(any(ends(item(rank, env, t + k))) for k in range(window - 1))


def starts(kind: str, world: int, steps: int) -> list[int]:
    """Every item a draw of ``kind`` can return (windows: their starts)."""
    every = [item(r, e, t) for r in range(world) for e in range(ENVS) for t in range(steps)]
    if kind == "n_step":
        return [i for i in every if nstep_window(i, steps) is not None]
    if kind == "slices":
        return [i for i in every if slice_start(i, steps)]
    return every


def chi2_ok(counts: dict[int, int], support: list[int], weights: list[float]) -> tuple[bool, str]:
    """A chi-square test of ``counts`` against ``weights`` over ``support`` (5 sigma)."""
    n = sum(counts.values())
    total = sum(weights)
    if set(counts) - set(support):
        return False, f"drew items outside the support: {sorted(set(counts) - set(support))[:5]}"
    chi2 = sum(
        (counts.get(i, 0) - n * w / total) ** 2 / (n * w / total) for i, w in zip(support, weights)
    )
    df = len(support) - 1
    return chi2 < df + 5 * math.sqrt(2 * df), f"chi2={chi2:.1f} df={df} n={n}"
