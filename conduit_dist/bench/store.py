"""``python -m conduit_dist.bench store``: put+round and fetch throughput at world size 1.

Side by side in one run: conduit_dist's ``DataPlane``, a hand-rolled preallocated ring buffer in
two variants and, when installed, TorchRL's ``ReplayBuffer(storage=LazyTensorStorage(N))``:

- ``ring_fresh`` inserts with a slice copy per field (two on wrap-around) and samples with
  ``randint`` + ``index_select`` per field into fresh tensors;
- ``ring_out`` inserts the same way and samples into preallocated outputs (``randint(out=)`` +
  ``index_select(..., out=)`` per field), as conduit's fetch lands in pooled buffers.

What one insert counts: for conduit ``plane.put(batch)`` + ``plane.flush()``, i.e. the copy into
the plane and the round that makes the items sampleable (``schedule="sync"``: ``flush`` returns
after that round, so the next ``fetch`` can draw them); for the rings the slice copies; for
TorchRL ``extend``. Two transitions (small, 525 B; Atari-like, 56 KB), batches of 256 and 4096,
insert and sample. Stores are prefilled to capacity first, so inserts overwrite memory already
touched (steady state). Where the stores of all systems fit in half the available memory (the
small transition) they are measured interleaved, block by block; otherwise one after another.
Every system runs with ``--threads`` intra-op threads (default 1, the neutral setting; with more,
torch's copies in the rings and TorchRL and conduit's large packs and gathers split over them).
Reports transitions/s (medians of timed blocks) and conduit's ratio over each baseline; the JSON
line's ``summary`` has ``min_vs_ring`` (against the faster ring variant of each cell),
``min_vs_ring_fresh``, ``min_vs_ring_out``, ``min_vs_torchrl`` and the same minima per op.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys

import torch

import conduit_dist as cd
from conduit_dist.bench.common import emit, median_times

TRANSITIONS = {
    "small": ({"obs": (64,), "next_obs": (64,)}, torch.float32, 1_000_000),
    "atari": ({"obs": (4, 84, 84), "next_obs": (4, 84, 84)}, torch.uint8, 100_000),
}


def make_batch(kind: str, n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A batch of ``n`` random transitions of the given kind."""
    shapes, dtype, _ = TRANSITIONS[kind]
    g = torch.Generator().manual_seed(seed)
    batch = {}
    for name, shape in shapes.items():
        if dtype == torch.uint8:
            batch[name] = torch.randint(0, 256, (n, *shape), dtype=torch.uint8, generator=g)
        else:
            batch[name] = torch.randn((n, *shape), generator=g)
    batch["action"] = torch.randint(0, 6, (n,), generator=g)
    batch["reward"] = torch.randn(n, generator=g)
    batch["done"] = torch.rand(n, generator=g) < 0.01
    return batch


class ConduitStore:
    """conduit_dist at world size 1: ``put`` + ``flush`` to insert, ``fetch`` to sample.

    ``schedule="sync"`` makes the insert cell count the whole path to sampleable items: ``flush``
    runs the round inline and returns once the items are in storage (at world size 1 on CPU
    rounds run inline under ``overlap`` too; naming it keeps that true on other devices).
    """

    name = "conduit"

    def __init__(self, example: dict[str, torch.Tensor], capacity: int) -> None:
        cd.init_distributed()
        spec = cd.ExperienceSpec.from_batch(example)
        self.plane = cd.DataPlane(spec, capacity, seed=0, schedule="sync")

    def __len__(self) -> int:
        return len(self.plane)

    def insert(self, batch: dict[str, torch.Tensor]) -> None:
        self.plane.put(batch)
        self.plane.flush()

    def sample(self, n: int) -> dict[str, torch.Tensor]:
        return self.plane.fetch(n, oversample=True)  # as the ring buffer: any size

    def close(self) -> None:
        self.plane.close()


class RingStore:
    """The baseline a practitioner writes by hand: one preallocated tensor per field.

    Inserts with a slice copy per field (two on wrap-around); samples into fresh tensors.
    """

    name = "ring_fresh"

    def __init__(self, example: dict[str, torch.Tensor], capacity: int) -> None:
        self.data = {
            k: torch.empty((capacity, *v.shape[1:]), dtype=v.dtype) for k, v in example.items()
        }
        self.capacity, self.pos, self.size = capacity, 0, 0

    def __len__(self) -> int:
        return self.size

    def insert(self, batch: dict[str, torch.Tensor]) -> None:
        n = next(iter(batch.values())).shape[0]
        first = min(n, self.capacity - self.pos)
        for k, v in batch.items():
            self.data[k][self.pos : self.pos + first].copy_(v[:first])
            if first < n:
                self.data[k][: n - first].copy_(v[first:])
        self.pos = (self.pos + n) % self.capacity
        self.size = min(self.capacity, self.size + n)

    def sample(self, n: int) -> dict[str, torch.Tensor]:
        idx = torch.randint(self.size, (n,))
        return {k: v.index_select(0, idx) for k, v in self.data.items()}

    def close(self) -> None:
        self.data = {}


class RingOutStore(RingStore):
    """The ring buffer sampling into preallocated outputs (one set per batch size, reused).

    Like conduit's pooled delivery buffers, the outputs are overwritten by the next sample of the
    same size; the first sample of a size allocates them (the timing's warm-up call).
    """

    name = "ring_out"

    def __init__(self, example: dict[str, torch.Tensor], capacity: int) -> None:
        super().__init__(example, capacity)
        self._out: dict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}

    def sample(self, n: int) -> dict[str, torch.Tensor]:
        if n not in self._out:
            self._out[n] = (
                torch.empty(n, dtype=torch.int64),
                {k: v.new_empty((n, *v.shape[1:])) for k, v in self.data.items()},
            )
        idx, out = self._out[n]
        torch.randint(self.size, (n,), out=idx)
        for k, v in self.data.items():
            torch.index_select(v, 0, idx, out=out[k])
        return out

    def close(self) -> None:
        super().close()
        self._out = {}


class TorchRLStore:
    """TorchRL's ``ReplayBuffer`` over ``LazyTensorStorage`` (TensorDicts built outside timing)."""

    name = "torchrl"

    def __init__(self, example: dict[str, torch.Tensor], capacity: int) -> None:
        from torchrl.data import LazyTensorStorage, ReplayBuffer

        self.rb = ReplayBuffer(storage=LazyTensorStorage(capacity))
        self._tds: dict[int, object] = {}

    def __len__(self) -> int:
        return len(self.rb)

    def _td(self, batch: dict[str, torch.Tensor]):
        from tensordict import TensorDict

        key = id(batch)
        if key not in self._tds:
            n = next(iter(batch.values())).shape[0]
            self._tds[key] = TensorDict(dict(batch), batch_size=[n])
        return self._tds[key]

    def insert(self, batch: dict[str, torch.Tensor]) -> None:
        self.rb.extend(self._td(batch))

    def sample(self, n: int):
        return self.rb.sample(n)

    def close(self) -> None:
        self.rb = None


SKIPPED: dict[str, str] = {}
"""Baselines that could not run in this process, and why (in the JSON's ``skipped``)."""


def _systems() -> list[type]:
    systems: list[type] = [ConduitStore, RingStore, RingOutStore]
    try:
        import torchrl.data  # noqa: F401

        systems.append(TorchRLStore)
    except Exception as exc:  # said on stderr and in the JSON, never dropped silently
        why = f"{type(exc).__name__}: {exc} (pip install -e '.[bench]')"
        if "torchrl" not in SKIPPED:  # once, not per transition kind
            print(f"bench store: the torchrl baseline cannot run: {why}", file=sys.stderr)
        SKIPPED["torchrl"] = why
    return systems


def _prefill(store, kind: str, capacity: int) -> None:
    """Fill ``store`` to capacity; checks each insert left its items sampleable (``len``)."""
    chunk = make_batch(kind, 4096, seed=99)
    for i in range((capacity + 4095) // 4096):
        store.insert(chunk)
        if len(store) != min(capacity, (i + 1) * 4096):
            raise RuntimeError(
                f"{store.name}: {len(store)} items sampleable after {i + 1} inserts of 4096 "
                f"into capacity {capacity}, expected {min(capacity, (i + 1) * 4096)}"
            )


def _measure(stores: list, inputs: dict, batches: list[int], min_time: float, repeats: int):
    """Per (store, batch, op): median seconds per call, the stores' blocks interleaved."""
    out = {}
    for bs in batches:
        fns = {}
        for store in stores:
            pair, state = inputs[bs], {"i": 0}

            def insert(store=store, pair=pair, state=state):
                state["i"] ^= 1
                store.insert(pair[state["i"]])

            fns[(store.name, bs, "insert")] = insert
            fns[(store.name, bs, "sample")] = lambda store=store, bs=bs: store.sample(bs)
        out.update(median_times(fns, min_time, repeats))
    return out


def run(
    kinds: list[str], batches: list[int], min_time: float, repeats: int, scale: float
) -> list[dict]:
    """Measure every system on every (transition, batch size, op); returns result rows.

    All systems of a transition are kept alive and measured interleaved when their stores fit in
    half the available memory (the small transition); otherwise one after another.
    """
    rows = []
    for kind in kinds:
        capacity = capacity_of(kind, scale)
        inputs = {bs: [make_batch(kind, bs, seed=s) for s in range(2)] for bs in batches}
        example = make_batch(kind, 2)
        per_store = capacity * sum(v[0].numel() * v.element_size() for v in example.values())
        systems = _systems()
        together = per_store * len(systems) < _available_bytes() // 2
        groups = [systems] if together else [[s] for s in systems]
        for group in groups:
            stores = []
            for system in group:
                store = system(example, capacity)
                _prefill(store, kind, capacity)
                stores.append(store)
            times = _measure(stores, inputs, batches, min_time, repeats)
            for (name, bs, op), t in times.items():
                rows.append(
                    {
                        "transition": kind,
                        "batch": bs,
                        "op": op,
                        "system": name,
                        "items_per_s": bs / t,
                        "interleaved": together,
                    }
                )
            for store in stores:
                store.close()
            del stores
            gc.collect()
    return rows


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


BASELINES = ("ring", "ring_fresh", "ring_out", "torchrl")  # "ring": the faster ring variant


def summarize(rows: list[dict]) -> tuple[list[dict], dict]:
    """Ratios of conduit over each baseline per (transition, batch, op), and their minima.

    ``vs_ring`` is against the faster of ``ring_fresh`` and ``ring_out`` in that cell (the
    fairest hand-rolled baseline); ``summary`` holds ``min_vs_<baseline>`` over all cells and
    per op (``by_op``).
    """
    table: dict[tuple, dict[str, float]] = {}
    for r in rows:
        table.setdefault((r["transition"], r["batch"], r["op"]), {})[r["system"]] = r["items_per_s"]
    ratios = []
    for (kind, bs, op), v in table.items():
        entry = {
            "transition": kind,
            "batch": bs,
            "op": op,
            **{f"{k}_per_s": x for k, x in v.items()},
        }
        rings = [v[k] for k in ("ring_fresh", "ring_out") if k in v]
        bases = {**v, "ring": max(rings)} if rings else dict(v)
        for base in BASELINES:
            if base in bases:
                entry[f"vs_{base}"] = v["conduit"] / bases[base]
        ratios.append(entry)

    def minima(entries: list[dict]) -> dict[str, float | None]:
        out = {}
        for base in BASELINES:
            vals = [e[f"vs_{base}"] for e in entries if f"vs_{base}" in e]
            out[f"min_vs_{base}"] = min(vals) if vals else None
        return out

    summary = minima(ratios)
    ops = sorted({e["op"] for e in ratios})
    summary["by_op"] = {op: minima([e for e in ratios if e["op"] == op]) for op in ops}
    return ratios, summary


INSERT_COUNTS = {
    "conduit": "put(batch) + flush(): the copy and the round making the items sampleable",
    "ring_fresh": "one slice copy per field (two on wrap-around)",
    "ring_out": "one slice copy per field (two on wrap-around)",
    "torchrl": "ReplayBuffer.extend(TensorDict built outside timing)",
}


def positive(kind: type):
    """An argparse ``type=`` for finite numbers of ``kind`` > 0 (argparse names the flag)."""
    what = "an integer" if kind is int else "a finite number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not 0 < value < math.inf:
            raise argparse.ArgumentTypeError(f"expected {what} > 0, got {text!r}")
        return value

    parse.__name__ = f"positive {kind.__name__}"
    return parse


def capacity_of(kind: str, scale: float) -> int:
    """Items each store holds for a transition kind at a capacity ``scale``."""
    return max(8192, int(TRANSITIONS[kind][2] * scale))


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse and check every option before anything is measured (errors name the flag)."""
    p = argparse.ArgumentParser(prog="python -m conduit_dist.bench store")
    p.add_argument("--kinds", nargs="+", default=list(TRANSITIONS), choices=list(TRANSITIONS))
    p.add_argument("--batches", nargs="+", type=positive(int), default=[256, 4096])
    p.add_argument("--min-time", type=positive(float), default=0.3, help="s per timed block")
    p.add_argument("--repeats", type=positive(int), default=5)
    p.add_argument("--scale", type=positive(float), default=1.0, help="capacity multiplier")
    p.add_argument(
        "--threads",
        type=positive(int),
        default=1,
        help="torch.set_num_threads for every system (1: the neutral setting; more: torch's "
        "copies and conduit's large packs and gathers split over them)",
    )
    a = p.parse_args(argv)
    smallest = min(capacity_of(k, a.scale) for k in a.kinds)
    if max(a.batches) > smallest:
        p.error(
            f"--batches: expected sizes <= the smallest store capacity ({smallest} items at "
            f"--scale {a.scale}), got {max(a.batches)}"
        )
    return a


def main(argv: list[str]) -> None:
    """Run the store benchmark and print the JSON line last."""
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    rows = run(a.kinds, a.batches, a.min_time, a.repeats, a.scale)
    ratios, summary = summarize(rows)
    for e in ratios:
        print(
            f"{e['transition']:>6} b={e['batch']:<5} {e['op']:<6} "
            + " ".join(f"{k}={v:,.0f}" for k, v in e.items() if k.endswith("_per_s"))
            + "  "
            + " ".join(f"{k}={v:.2f}" for k, v in e.items() if k.startswith("vs_"))
        )
    emit(
        "store", ratios, summary, threads=a.threads, insert_counts=INSERT_COUNTS,
        skipped=dict(SKIPPED),
    )  # fmt: skip


if __name__ == "__main__":
    main(__import__("sys").argv[1:])
