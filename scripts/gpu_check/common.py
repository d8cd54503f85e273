"""What the GPU check's steps share: items whose every field is a function of their id (so any
delivered row can be checked against what was put, on the device), host-read counting, the
SHA-256 of a shard's live items, and the ``ok`` lines with the numbers the summary collects.

Every step is a script run by ``scripts/gpu_check.sh`` (directly or under ``torchrun``); a check
that does not hold raises, so the step exits non-zero and the shell script stops there.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

OBS = (4, 16, 16)  # uint8 observation of every item (1 KiB)
# GPU_CHECK_DRY_RUN=cpu rehearses the steps' logic on the CPU (tests/test_gpu_check.py): device
# and pinned tiers become host tiers, CUDA-only checks are skipped, and every line says so.
# scripts/gpu_check.sh never sets it, and refuses to run where it is set.
DRY = os.environ.get("GPU_CHECK_DRY_RUN") == "cpu"
DEVICE = "cpu" if DRY else "cuda"
HOST_READS = {"__bool__", "item", "tolist", "__float__", "__int__", "__index__", "cpu", "numpy"}


class CheckFailed(AssertionError):
    """A check of the GPU check did not hold."""


def check(cond: bool, what: str) -> None:
    """Raise :class:`CheckFailed` with ``what`` unless ``cond`` (not an ``assert``: ``-O``
    cannot strip it)."""
    if not cond:
        raise CheckFailed(what)


def rank() -> int:
    """This process's global rank (0 without a group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def ok(step: str, message: str, **numbers: object) -> None:
    """Print ``ok <step>: <message>`` on rank 0 and keep ``numbers`` for the summary line
    (appended to ``$GPU_CHECK_OUT/results.jsonl``)."""
    if rank() != 0:
        return
    print(f"ok {step}: {message}" + (" [CPU DRY RUN, not a GPU check]" if DRY else ""), flush=True)
    out = os.environ.get("GPU_CHECK_OUT")
    if out:
        with open(os.path.join(out, "results.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, **numbers}) + "\n")


def items(ids: torch.Tensor, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """A batch whose fields are functions of ``ids`` (int64 ``[n]``): ``id``, ``obs`` (uint8
    ``OBS``), three float fields (``reward``: ``id / 2`` exact below 2**24; ``value``: float64;
    ``adv``: float32 ``[2]``), ``env`` (``id // 1_000_000 % 1000``: the stream of
    :func:`stream_ids`) and ``done``/``truncated`` (never: windows end only at the stream's
    start)."""
    ids = ids.to(device=device, dtype=torch.int64)
    n, width = ids.shape[0], int(np.prod(OBS))
    cols = torch.arange(width, device=ids.device)
    obs = ((ids[:, None] * 7 + cols) % 251).to(torch.uint8).view(n, *OBS)
    return {
        "id": ids,
        "obs": obs,
        "reward": (ids % (1 << 24)).float() / 2,
        "value": ids.double() * 0.25,
        "adv": torch.stack([(ids % 1000).float(), -(ids % 777).float()], dim=1),
        "env": ids // 1_000_000 % 1000,
        "done": torch.zeros(n, dtype=torch.bool, device=ids.device),
        "truncated": torch.zeros(n, dtype=torch.bool, device=ids.device),
    }


def stream_ids(rank: int, env: int, steps: torch.Tensor) -> torch.Tensor:
    """Ids of steps ``steps`` of stream ``env`` on ``rank``: consecutive steps, consecutive
    ids."""
    return rank * 1_000_000_000 + env * 1_000_000 + steps


def verify(batch: dict[str, torch.Tensor], device: torch.device) -> int:
    """Check every delivered row (items ``[B]`` or windows ``[B, T]``) against what
    :func:`items` makes of its id, on ``device``; returns the rows checked.

    Raises:
        CheckFailed: on a field off ``device`` or a value that is not the put one.
    """
    ids = batch["id"]
    fields = ("obs", "reward", "value", "adv", "env")
    for name in ("id", *fields):
        check(batch[name].device == device, f"field {name!r} on {batch[name].device}, not {device}")
    want = items(ids.reshape(-1), device)
    for name in fields:
        got = batch[name].reshape(want[name].shape)
        check(torch.equal(got, want[name]), f"field {name!r} differs from what was put")
    return int(ids.numel())


class Reads(TorchFunctionMode):
    """Counts host reads of torch tensors (``item``, ``tolist``, ``bool``, ``cpu``, ...): on a
    CUDA tensor each is a host sync."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def live_rows(plane) -> np.ndarray:
    """This shard's live items, oldest first, as host bytes (the user's fields only)."""
    shard = plane.shard
    gens = torch.arange(shard.oldest, shard.written)
    width = shard.tiers[0].record_bytes
    out = torch.empty((gens.numel(), width), dtype=torch.uint8)
    shard.gather(gens, out)
    return out[:, : plane.spec.record_bytes].numpy().copy()


def digest(rows: list[np.ndarray]) -> str:
    """SHA-256 of the item bytes of every shard, sorted (independent of where each item is)."""
    allrows = np.concatenate(rows)
    order = np.lexsort(allrows.T[::-1])
    return hashlib.sha256(allrows[order].tobytes()).hexdigest()


def tier(kind: str) -> str:
    """``kind``, or ``host`` for a device or pinned tier in a dry run."""
    return "host" if DRY and kind in ("device", "pinned") else kind


def sync() -> None:
    """Wait for the GPU (nothing in a dry run)."""
    if not DRY:
        torch.cuda.synchronize()


def median_ms(fn, reps: int = 20) -> float:
    """Median wall milliseconds of ``fn()``, the device synchronised around each call."""
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]
