"""``torchrun --standalone --nproc_per_node=2 -m conduit_dist.bench rounds``: a round's fixed cost.

Side by side in one run, a sync round (``fetch`` on every rank, after an untimed ``put``) against
the raw ``all_to_all_single`` calls of the same sizes: while a round runs, the plane's exchange
records every all-to-all it launches (bytes sent to and received from each peer); the baseline
replays exactly those calls from ready buffers, nothing else, through the entry point the plane
uses (the process group's ``alltoall_base``, on a group of its own: ``dist.all_to_all_single``
adds ~0.04 ms of Python-side checks a call here, which would flatter the plane).
Where the plane moves host rows through shared memory (``--shared-memory``: ``auto``, the
plane's default, is on for ranks of one host), the same calls are also replayed raw through a
shared-memory exchange of their own (``raw_shm_ms``: the round's own transport, like for like);
``raw_ms`` stays gloo's (the neutral floor). Both start after a barrier; each sample is the
slowest rank's wall time (a round ends when its last rank does) and the CPU time
(``time.process_time``: every thread of the process, gloo's included), medians over samples,
interleaved sample by sample.

Cases (DQN-sized records: 56 bytes; every rank puts ``--put`` items and fetches ``--batch``):

- ``fused``: ``placement="local"`` with the uniform sampler: meta, ingestion and delivery in one
  exchange (``fused.py``);
- ``fused_grads``: the same carrying a ``reduce`` payload of DQN's gradients (17,282 floats), as
  ``train.py``'s ``grad_sync=round`` does (it moves more than 64 KB);
- ``three_exchange``: ``placement="round_robin"``: meta gather, ingestion, delivery.
- ``main_job``: the README main job's round: 3-step windows over each env's stream with
  prioritized draws (``Windows(n_step=3)``, ``Prioritized(alpha=0.6)``), the gradients' payload,
  ``update_priorities`` for every batch (it only queues; the round carries them), and
  ``--batch`` split over the learners as the job's ``algo.batch_size`` is (64 each of 2).

Allocations per round, after the timed samples (``--alloc-rounds`` more rounds, the most over
ranks): ``torch_allocs`` and ``torch_alloc_bytes``, the tensors a round's torch ops allocate
(``put`` + ``fetch``, inline; :class:`TensorAllocations`: on CPU every one is a ``malloc``, on
CUDA a request to the caching allocator); ``py_peak_bytes``, the most a round's Python objects
and NumPy arrays held above what was live when it began (``tracemalloc``; the median round).

Exposed latency (``--backward-ms B``): one-exchange rounds started by ``fetch_start`` before a
backward of ``B`` ms (a sleep: a GPU's backward leaves the host free), then fetched; each sample
is ``fetch_start``'s own time plus the wait in ``fetch`` (slowest rank), ``exposed_ms`` the
median (``bench sim`` checks the simulator's exposed latency against it).

The JSON line's ``summary`` has per case ``round_ms``, ``raw_ms``, ``vs_raw`` (round / raw gloo,
wall), ``round_cpu_ms``, ``raw_cpu_ms``, ``cpu_vs_raw``, with shared memory ``raw_shm_ms``,
``raw_shm_cpu_ms``, ``vs_raw_shm`` and ``cpu_vs_raw_shm`` (``None`` without), ``shared_memory``
(whether the plane used it), ``calls`` and ``bytes`` (per rank, sent), the allocation counts
above, and ``fused_vs_three_exchange`` (the fused round's wall over the three-exchange
round's, when both run). ``--cases`` picks cases (``bench sim`` runs the three it models).
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import conduit_dist as cd
from conduit_dist.bench.common import emit, number
from conduit_dist.collectives.exchange import Exchange

GRAD_NUMEL = 17_282  # DQN's Q-network [4 -> 128 -> 128 -> 2]


def _batch(n: int, streams: bool = False) -> dict[str, torch.Tensor]:
    """``n`` CartPole-sized transitions; ``streams``: with the main job's ``truncated`` and
    ``env`` fields (one env stream per item, an episode ending now and then)."""
    batch = {
        "obs": torch.randn(n, 4),
        "action": torch.randint(0, 2, (n,)),
        "reward": torch.randn(n),
        "next_obs": torch.randn(n, 4),
        "done": torch.zeros(n, dtype=torch.bool),
    }
    if streams:
        batch["done"] = torch.rand(n) < 0.05
        batch["truncated"] = torch.zeros(n, dtype=torch.bool)
        batch["env"] = torch.arange(n)
    return batch


def _main_job_sampler() -> cd.Prioritized:
    """The main job's sampler (``conf/experiment/cartpole_per.yaml``)."""
    seq = cd.Windows(n_step=3, gamma=0.99, done="done", truncated="truncated", stream="env")
    return cd.Prioritized(alpha=0.6, beta=0.4, eps=1e-6, sequence=seq)


CASES = {  # name: placement, payload floats, sampler (the module docstring says what each is)
    "fused": ("local", 0, "uniform"),
    "fused_grads": ("local", GRAD_NUMEL, "uniform"),
    "three_exchange": ("round_robin", 0, "uniform"),
    "main_job": ("local", GRAD_NUMEL, _main_job_sampler),
}


class _Raw:
    """Buffers replaying recorded all-to-alls on ``group`` (byte splits), called as the plane
    calls them."""

    def __init__(self, calls: list[tuple[str, list[int], list[int]]], group, shm=None) -> None:
        self.group, self.shm, self.opts = group, shm, dist.AllToAllOptions()
        self.calls = []
        for _op, sent, got in calls:
            inp = torch.zeros(sum(sent), dtype=torch.uint8)
            out = torch.empty(sum(got), dtype=torch.uint8)
            self.calls.append((out, inp, got, sent))

    def __call__(self) -> None:
        for out, inp, got, sent in self.calls:
            self.group.alltoall_base(out, inp, got, sent, self.opts).wait()

    def shared(self) -> None:
        """The same calls through shared memory (``collectives/shm.py``)."""
        for out, inp, got, sent in self.calls:
            self.shm.start(out, inp, got, sent).wait()


def _sample(fn) -> tuple[float, float]:
    dist.barrier()
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


class TensorAllocations(TorchDispatchMode):
    """Counts the tensors torch ops allocate on this thread while the mode is on: an op's outputs
    whose storage no input had before the op (a view, an in-place op or an ``out=`` write into
    a buffer large enough allocates nothing; an ``out=`` buffer resized counts), and tensors made
    from Python data (``torch.tensor(list)``: ``lift_fresh``).

    A lower bound of what the profiler's memory events counted: temporaries inside an op and the
    buffers C++ code (gloo) allocates are not seen, nor other threads' ops. The profiler is not
    used: stopping it while gloo's threads ran this process's collectives crashed a rank
    (SIGSEGV in a gloo thread, 1 run in 4 here)."""

    _FRESH = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)

    def __init__(self) -> None:
        super().__init__()
        self.count, self.nbytes = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        fresh = func in self._FRESH  # its input was made from Python data, or wraps NumPy's
        inputs = () if fresh else _tensors((args, kwargs))
        before = {t.untyped_storage().data_ptr() for t in inputs}
        out = func(*args, **kwargs)
        for t in _tensors(out):
            storage = t.untyped_storage()
            if fresh and not storage.resizable():  # memory torch did not allocate (from_numpy)
                continue
            if storage.nbytes() and storage.data_ptr() not in before:
                before.add(storage.data_ptr())  # two outputs on one new storage: one allocation
                self.count += 1
                self.nbytes += storage.nbytes()
        return out


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _allocations(step, rounds: int) -> dict[str, float]:
    """Allocations of ``rounds`` calls of ``step`` (a put and its round, inline: ``sync``), per
    round, the most over ranks: tensors (:class:`TensorAllocations`) and Python/NumPy
    (``tracemalloc``)."""
    with TensorAllocations() as allocs:
        for _ in range(rounds):
            step()
    peaks = []
    tracemalloc.start()
    try:
        for _ in range(rounds):
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            step()
            peaks.append(tracemalloc.get_traced_memory()[1] - before)
    finally:
        tracemalloc.stop()
    mine = [allocs.count / rounds, allocs.nbytes / rounds, statistics.median(peaks)]
    t = torch.tensor(mine, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    keys = ("torch_allocs", "torch_alloc_bytes", "py_peak_bytes")
    return dict(zip(keys, t.tolist(), strict=True))


def _exposed(plane: cd.DataPlane, a, payload: torch.Tensor | None, batch, size: int) -> float:
    """Median exposed ms of a fused round started at a backward of ``a.backward_ms``: the time
    in ``fetch_start`` plus the wait in ``fetch`` after the backward (slowest rank). The backward
    is a sleep: a GPU's backward leaves the host free, as here."""
    samples = []
    for _ in range(a.samples):
        plane.put(batch)
        dist.barrier()
        t = time.perf_counter()
        plane.fetch_start(size, reduce=payload)
        started = time.perf_counter() - t
        time.sleep(a.backward_ms * 1e-3)
        t = time.perf_counter()
        plane.fetch(size)
        samples.append(started + time.perf_counter() - t)
    t = torch.tensor(samples, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist()) * 1e3


def _case(
    name: str, plane: cd.DataPlane, a, payload: torch.Tensor | None, group, raw_shm,
    prioritized: bool = False,
) -> dict:  # fmt: skip
    """Interleave ``a.samples`` rounds and raw replays of that round's calls (through gloo,
    and through ``raw_shm``, a shared-memory exchange, where the plane uses shared memory);
    ``prioritized``: the main job's items and priority updates."""
    batch = _batch(a.put, streams=prioritized)
    ex = plane._p.exchange  # the plane's own exchange records what its round launches
    shm = raw_shm if ex.shm is not None else None
    size = a.batch // dist.get_world_size() if prioritized else a.batch
    priorities = torch.rand(size, dtype=torch.float32)

    def round_() -> None:
        b = plane.fetch(size, reduce=payload)  # None: no payload
        if prioritized:  # queued here, carried by the next round (as the main job does)
            plane.update_priorities(b["_index"], priorities)

    # fill first: a fetch larger than the store is refused (EmptyStoreError) since fetches no
    # longer oversample silently; the first round ingests these before it draws
    for _ in range(-(-a.batch // a.put) + 1):
        plane.put(batch)
    for _ in range(a.warmup):
        plane.put(batch)
        round_()
    walls, cpus, raw_walls, raw_cpus, shm_walls, shm_cpus, sizes = [], [], [], [], [], [], []
    for _ in range(a.samples):
        plane.put(batch)
        ex.record = []
        w, c = _sample(round_)
        calls, ex.record = ex.record, None
        raw = _Raw(calls, group, shm)
        rw, rc = _sample(raw)
        sw, sc = _sample(raw.shared) if shm is not None else (1.0, 1.0)
        walls.append(w)
        cpus.append(c)
        raw_walls.append(rw)
        raw_cpus.append(rc)
        shm_walls.append(sw)
        shm_cpus.append(sc)
        sizes.append((len(calls), sum(sum(s) for _, s, _ in calls)))

    def step() -> None:
        plane.put(batch)
        round_()

    allocs = _allocations(step, a.alloc_rounds)
    # fetch_start leaves one-exchange (fused) rounds in flight; the others have no exposed time
    fused = plane.schedule == "fused"
    exposed = _exposed(plane, a, payload, batch, size) if a.backward_ms and fused else None
    t = torch.tensor([walls, raw_walls, shm_walls], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a round ends when its slowest rank ends
    c = torch.tensor([cpus, raw_cpus, shm_cpus], dtype=torch.float64)
    dist.all_reduce(c, op=dist.ReduceOp.SUM)
    c /= dist.get_world_size()  # CPU: mean over ranks
    med = [statistics.median(row) * 1e3 for row in t.tolist()]
    cmed = [statistics.median(row) * 1e3 for row in c.tolist()]
    calls, nbytes = statistics.median_low(sizes)
    return {
        "case": name,
        "round_ms": med[0],
        "raw_ms": med[1],
        "vs_raw": med[0] / med[1],
        "round_cpu_ms": cmed[0],
        "raw_cpu_ms": cmed[1],
        "cpu_vs_raw": cmed[0] / cmed[1],
        "shared_memory": shm is not None,
        "raw_shm_ms": med[2] if shm is not None else None,
        "raw_shm_cpu_ms": cmed[2] if shm is not None else None,
        "vs_raw_shm": med[0] / med[2] if shm is not None else None,
        "cpu_vs_raw_shm": cmed[0] / cmed[2] if shm is not None else None,
        "calls": calls,
        "bytes": nbytes,
        "exposed_ms": exposed,  # with --backward-ms, one-exchange rounds (fetch_start)
        **allocs,
    }


def main(argv: list[str]) -> None:
    """Run the rounds benchmark (every rank) and print the JSON line last on rank 0."""
    p = argparse.ArgumentParser(prog="python -m conduit_dist.bench rounds")
    p.add_argument("--put", type=number(int, 1), default=8, help="items each rank puts a round")
    p.add_argument("--batch", type=number(int, 1), default=128, help="items each rank fetches")
    p.add_argument("--samples", type=number(int, 10), default=1000)
    p.add_argument("--warmup", type=number(int, 1), default=200)
    p.add_argument("--alloc-rounds", type=number(int, 1), default=100, help="rounds counted")
    p.add_argument(
        "--bandwidth", choices=("declared", "calibrate"), default="declared",
        help="the planes' cost model: declared numbers, or calibrated at start-up (and cached)",
    )  # fmt: skip
    p.add_argument("--bandwidth-cache", default="~/.cache/conduit_dist", help="calibration cache")
    p.add_argument("--backward-ms", type=number(float, 0.0), default=0.0,
                   help="also time what a round started at a backward this long leaves exposed "
                        "(one-exchange rounds, fetch_start; 0: not measured)")  # fmt: skip
    p.add_argument("--shared-memory", choices=("auto", "true", "false"), default="auto",
                   help="the planes' transport.shared_memory (auto: the default, on for ranks of "
                        "one host); with it the calls are replayed through gloo and through "
                        "shared memory")  # fmt: skip
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES),
                   help="cases to run (default: every one)")  # fmt: skip
    a = p.parse_args(argv)
    cd.init_distributed()
    torch.set_num_threads(1)
    cases = [(name, *CASES[name]) for name in CASES if name in a.cases]
    group = dist.new_group()  # the baseline's own group, like the plane's
    shared = {"auto": "auto", "true": True, "false": False}[a.shared_memory]
    # the shared-memory baseline's own exchange (its files, its barrier), like the plane's
    raw_ex = Exchange(60.0, name="bench-raw", shared_memory=shared)
    results = []
    for name, placement, numel, sampler in cases:
        transport = cd.TransportConfig(
            bandwidth=a.bandwidth, bandwidth_cache=a.bandwidth_cache, shared_memory=shared
        )
        streams = sampler != "uniform"
        spec = cd.ExperienceSpec.from_batch(_batch(1, streams))
        plane = cd.DataPlane(
            spec, 50_000, placement=placement, schedule="sync", reduce_numel=numel,
            transport=transport, sampler=sampler() if streams else sampler,
        )  # fmt: skip
        try:
            payload = torch.randn(numel) if numel else None
            results.append(_case(name, plane, a, payload, group, raw_ex.shm, streams))
        finally:
            plane.close()
    raw_ex.close(drain=True)
    by = {r["case"]: r for r in results}
    summary = {name: {k: v for k, v in r.items() if k != "case"} for name, r in by.items()}
    if "fused" in by and "three_exchange" in by:
        fused, three = by["fused"]["round_ms"], by["three_exchange"]["round_ms"]
        summary["fused_vs_three_exchange"] = fused / three
    if dist.get_rank() == 0:
        for r in results:
            own = (
                f"; raw shm {r['raw_shm_ms']:.3f} ms ({r['vs_raw_shm']:.2f}x), CPU "
                f"{r['raw_shm_cpu_ms']:.3f} ms ({r['cpu_vs_raw_shm']:.2f}x)"
                if r["shared_memory"]
                else ""
            )
            print(
                f"{r['case']:>15}: round {r['round_ms']:.3f} ms, raw gloo {r['raw_ms']:.3f} ms "
                f"({r['vs_raw']:.2f}x); CPU {r['round_cpu_ms']:.3f} vs {r['raw_cpu_ms']:.3f} ms "
                f"({r['cpu_vs_raw']:.2f}x){own}; {r['calls']} call(s), {r['bytes']} B sent; "
                f"a round allocates {r['torch_allocs']:.1f} tensors "
                f"({r['torch_alloc_bytes']:.0f} B), Python/NumPy peak {r['py_peak_bytes']:.0f} B",
                flush=True,
            )
        emit("rounds", results, summary, world=dist.get_world_size(), put=a.put, batch=a.batch,
             backward_ms=a.backward_ms, shared_memory=a.shared_memory)  # fmt: skip
    cd.destroy_distributed()
