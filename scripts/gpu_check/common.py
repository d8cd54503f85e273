"""What the GPU check's steps share: items whose every field is a function of their id (so any
delivered row can be checked against what was put, on the device), host-read and host-sync
counting, the SHA-256 of a shard's live items, puts from a second thread, the device's memory
and a timed sleep kernel, and the ``ok`` lines with the numbers the summary collects.

Every step is a script run by ``scripts/gpu_check.sh`` (directly or under ``torchrun``); a check
that does not hold raises, so the step exits non-zero and the shell script stops there.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
import warnings
from collections import Counter

import numpy as np
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from conduit_dist.rounds.devices import REHEARSAL_ENV
from conduit_dist.syncs import SYNCS

OBS = (4, 16, 16)  # uint8 observation of every item (1 KiB)
# GPU_CHECK_DRY_RUN=cpu rehearses the steps' logic on the CPU (tests/test_gpu_check.py): device
# and pinned tiers become host tiers, CUDA-only checks are skipped, and every line says so.
# scripts/gpu_check.sh never sets it, and refuses to run where it is set.
DRY = os.environ.get("GPU_CHECK_DRY_RUN") == "cpu"
DEVICE = "cpu" if DRY else "cuda"
HOST_READS = {"__bool__", "item", "tolist", "__float__", "__int__", "__index__", "cpu", "numpy"}
# what torch.cuda.set_sync_debug_mode("warn") says at every synchronizing CUDA call
# (c10::cuda::warn_or_error_on_sync: a D2H or pageable H2D copy, item(), a stream's synchronize)
SYNC_WARNING = "called a synchronizing CUDA operation"


class CheckFailed(AssertionError):
    """A check of the GPU check did not hold."""


def check(cond: bool, what: str) -> None:
    """Raise :class:`CheckFailed` with ``what`` unless ``cond`` (not an ``assert``: ``-O``
    cannot strip it)."""
    if not cond:
        raise CheckFailed(what)


def skip(step: str, reason: str) -> None:
    """Print ``skip <step>: <reason>`` on rank 0 and record it for the summary (its
    ``skipped``)."""
    if rank() != 0:
        return
    print(f"skip {step}: {reason}", flush=True)
    _record({"step": step, "skipped": reason})


def _record(entry: dict[str, object]) -> None:
    out = os.environ.get("GPU_CHECK_OUT")
    if out:
        with open(os.path.join(out, "results.jsonl"), "a") as f:
            f.write(json.dumps(entry) + "\n")


def rank() -> int:
    """This process's global rank (0 without a group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def ok(step: str, message: str, **numbers: object) -> None:
    """Print ``ok <step>: <message>`` on rank 0 and keep ``numbers`` for the summary line
    (appended to ``$GPU_CHECK_OUT/results.jsonl``)."""
    if rank() != 0:
        return
    print(f"ok {step}: {message}" + (" [CPU DRY RUN, not a GPU check]" if DRY else ""), flush=True)
    _record({"step": step, **numbers})


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


class SyncWatch:
    """Host syncs made inside :meth:`count` blocks, per block: torch's own (every synchronizing
    CUDA call warns under ``torch.cuda.set_sync_debug_mode("warn")``; the warnings are caught,
    from any thread, and counted) and the library's deliberate ones (``conduit_dist.syncs``: an
    event waited on because it had not passed yet), by reason. Nothing is set in a dry run (a CPU
    has no sync to count: the counts stay 0, the bookkeeping runs)."""

    def __init__(self) -> None:
        self.torch: list[int] = []  # torch's syncs in each block
        self.library: list[int] = []  # the library's in each block
        self.reasons: Counter[str] = Counter()  # the library's, by reason, over every block
        self.sites: Counter[str] = Counter()  # "file:line" of the Python call behind torch's

    @contextlib.contextmanager
    def count(self):
        """Count the host syncs of the block (one entry in :attr:`torch` and :attr:`library`)."""
        before = SYNCS.snapshot()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if not DRY:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                if not DRY:
                    torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if SYNC_WARNING in str(w.message)]
        for w in caught:  # other warnings go on as they would have
            if w not in syncs:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        self.sites.update(f"{os.path.basename(w.filename)}:{w.lineno}" for w in syncs)
        after = SYNCS.snapshot()
        grew = {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}
        self.reasons.update(grew)
        self.torch.append(len(syncs))
        self.library.append(sum(grew.values()))

    def since(self, first: int) -> dict[str, float]:
        """Blocks ``first..`` (the steady state): the most and the mean of each kind."""
        t, lib = self.torch[first:] or [0], self.library[first:] or [0]
        return {
            "blocks": len(self.torch[first:]),
            "torch_max": max(t),
            "torch_mean": sum(t) / len(t),
            "library_max": max(lib),
            "library_mean": sum(lib) / len(lib),
        }

    def within(self, first: int, torch_max: int, library_max: int, what: str) -> dict:
        """Check blocks ``first..`` against the budget (the most of each kind in any block);
        returns :meth:`since`.

        Raises:
            CheckFailed: naming the counts, the budget, the library's reasons and the call
                sites of torch's syncs.
        """
        got = self.since(first)
        check(
            got["torch_max"] <= torch_max and got["library_max"] <= library_max,
            f"{what}: host syncs per block {got} over the budget (torch {torch_max}, library "
            f"{library_max}); library reasons {dict(self.reasons)}; torch's at "
            f"{self.sites.most_common(6)}",
        )
        return got


THREAD_HOOKS: list = []  # called first on the threads put_in_thread starts (sanitizer.py's)


def put_in_thread(plane, batch: dict[str, torch.Tensor]) -> None:
    """``plane.put(batch)`` from a second Python thread (joined; its error re-raised here),
    which first calls every :data:`THREAD_HOOKS` function."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            for hook in THREAD_HOOKS:
                hook()
            plane.put(batch)
        except BaseException as e:  # surfaced below, on the main thread
            errors.append(e)

    t = threading.Thread(target=run, name="gpu-check-put")
    t.start()
    t.join(60)
    check(not t.is_alive(), "a put from a second thread did not return in 60 s")
    if errors:
        raise errors[0]


def memory(dev: torch.device) -> tuple[int, int]:
    """``(allocated, reserved)`` bytes of the CUDA caching allocator on ``dev`` once the device
    is idle (``(0, 0)`` in a dry run). A tiny allocation first makes the allocator process the
    frees that waited for another stream's event (``record_stream``), so what is counted as
    allocated is what is held."""
    if DRY:
        return 0, 0
    torch.cuda.synchronize(dev)
    torch.empty(1, device=dev)
    return torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)


def sleep_rate(dev: torch.device) -> float:
    """Cycles per second of ``torch.cuda._sleep`` on ``dev`` (timed once by CUDA events on the
    current stream): what :func:`gpu_sleep` converts seconds with."""
    stream = torch.cuda.current_stream(dev)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)  # the kernel loaded
    cycles = 20_000_000
    start.record(stream)
    torch.cuda._sleep(cycles)
    end.record(stream)
    end.synchronize()
    return cycles / max(start.elapsed_time(end) / 1e3, 1e-6)


def gpu_sleep(seconds: float, rate: float, dev: torch.device) -> torch.cuda.Event:
    """Queue a kernel that keeps ``dev``'s current stream busy for ``seconds`` (``rate``:
    :func:`sleep_rate`); returns an event recorded right after it (``query()`` is ``False``
    while it still runs)."""
    torch.cuda._sleep(int(seconds * rate))
    return torch.cuda.current_stream(dev).record_event()


# How much the CUDA caching allocator's counts may grow between round 50 and round 300 of a
# plane whose puts and fetches keep one size (by then every pool, staging and index buffer has
# its steady size, and nothing should be allocated for good any more):
ALLOCATED_SLACK = 64 * 1024
# allocated: a leak of anything a round is at least one 512-byte block (the allocator's
# smallest) a round, 125 KiB over 250 rounds: above this.
RESERVED_SLACK = 20 * 2**20
# reserved: the allocator may map one more segment when a freed block is still in use by
# another stream at a request (20 MiB, its segment for requests of 1-10 MiB; 2 MiB for small
# ones); a leak of one batch a round (>= 256 KiB here) reserves > 60 MiB over 250 rounds.


def memory_flat(early: tuple[int, int], late: tuple[int, int], what: str) -> dict[str, int]:
    """Check the growth from ``early`` to ``late`` (:func:`memory` pairs) against the slack;
    returns the numbers (bytes)."""
    grew = {"allocated": late[0] - early[0], "reserved": late[1] - early[1]}
    check(
        grew["allocated"] <= ALLOCATED_SLACK and grew["reserved"] <= RESERVED_SLACK,
        f"{what}: CUDA memory grew from {early} to {late} bytes (allocated, reserved) between "
        f"the rounds compared; slack {ALLOCATED_SLACK} and {RESERVED_SLACK}",
    )
    return {
        "allocated_early": early[0], "allocated_late": late[0], "allocated_grew": grew["allocated"],
        "reserved_early": early[1], "reserved_late": late[1], "reserved_grew": grew["reserved"],
    }  # fmt: skip


@contextlib.contextmanager
def rehearsal(on: bool):
    """Planes built in the block rehearse the device-rows path on the CPU when ``on``
    (``CONDUIT_DEVICE_ROWS_REHEARSAL=1``, read once, when a plane plans its devices); not
    otherwise, whatever the environment says."""
    before = os.environ.pop(REHEARSAL_ENV, None)
    if on:
        os.environ[REHEARSAL_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(REHEARSAL_ENV, None)
        if before is not None:
            os.environ[REHEARSAL_ENV] = before
