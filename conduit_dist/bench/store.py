"""``python -m conduit_dist.bench store``: put+round and fetch throughput at world size 1.

Side by side in one run: conduit_dist's ``DataPlane``, a hand-rolled preallocated ring buffer
(slice copy per field to insert; ``randint`` + ``index_select`` per field to sample) and, when
installed, TorchRL's ``ReplayBuffer(storage=LazyTensorStorage(N))``. Two transitions (small, 525 B;
Atari-like, 56 KB), batches of 256 and 4096, insert and sample. Stores are prefilled to capacity
first, so inserts overwrite memory already touched (steady state). Where the stores of all systems
fit in half the available memory (the small transition) they are measured interleaved, block by
block; otherwise one after another. Reports transitions/s (medians) and ratios; the JSON line's
``summary`` has ``min_vs_torchrl`` and ``min_vs_ring``.
"""

from __future__ import annotations

import argparse
import gc

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
    """conduit_dist at world size 1: ``put`` + ``flush`` to insert, ``fetch`` to sample."""

    name = "conduit"

    def __init__(self, example: dict[str, torch.Tensor], capacity: int) -> None:
        cd.init_distributed()
        self.plane = cd.DataPlane(cd.ExperienceSpec.from_batch(example), capacity, seed=0)

    def insert(self, batch: dict[str, torch.Tensor]) -> None:
        self.plane.put(batch)
        self.plane.flush()

    def sample(self, n: int) -> dict[str, torch.Tensor]:
        return self.plane.fetch(n)

    def close(self) -> None:
        self.plane.close()


class RingStore:
    """The baseline a practitioner writes by hand: one preallocated tensor per field."""

    name = "ring"

    def __init__(self, example: dict[str, torch.Tensor], capacity: int) -> None:
        self.data = {
            k: torch.empty((capacity, *v.shape[1:]), dtype=v.dtype) for k, v in example.items()
        }
        self.capacity, self.pos, self.size = capacity, 0, 0

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


class TorchRLStore:
    """TorchRL's ``ReplayBuffer`` over ``LazyTensorStorage`` (TensorDicts built outside timing)."""

    name = "torchrl"

    def __init__(self, example: dict[str, torch.Tensor], capacity: int) -> None:
        from torchrl.data import LazyTensorStorage, ReplayBuffer

        self.rb = ReplayBuffer(storage=LazyTensorStorage(capacity))
        self._tds: dict[int, object] = {}

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


def _systems() -> list[type]:
    systems: list[type] = [ConduitStore, RingStore]
    try:
        import torchrl.data  # noqa: F401

        systems.append(TorchRLStore)
    except Exception:
        pass
    return systems


def _prefill(store, kind: str, capacity: int) -> None:
    chunk = make_batch(kind, 4096, seed=99)
    for _ in range((capacity + 4095) // 4096):
        store.insert(chunk)


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
        capacity = max(8192, int(TRANSITIONS[kind][2] * scale))
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


def summarize(rows: list[dict]) -> tuple[list[dict], dict]:
    """Ratios of conduit over each baseline per (transition, batch, op), and their minima."""
    table: dict[tuple, dict[str, float]] = {}
    for r in rows:
        table.setdefault((r["transition"], r["batch"], r["op"]), {})[r["system"]] = r["items_per_s"]
    ratios, summary = [], {}
    for (kind, bs, op), v in table.items():
        entry = {
            "transition": kind,
            "batch": bs,
            "op": op,
            **{f"{k}_per_s": x for k, x in v.items()},
        }
        for base in ("ring", "torchrl"):
            if base in v:
                entry[f"vs_{base}"] = v["conduit"] / v[base]
        ratios.append(entry)
    for base in ("ring", "torchrl"):
        vals = [e[f"vs_{base}"] for e in ratios if f"vs_{base}" in e]
        summary[f"min_vs_{base}"] = min(vals) if vals else None
    return ratios, summary


def main(argv: list[str]) -> None:
    """Run the store benchmark and print the JSON line last."""
    p = argparse.ArgumentParser(prog="python -m conduit_dist.bench store")
    p.add_argument("--kinds", nargs="+", default=list(TRANSITIONS), choices=list(TRANSITIONS))
    p.add_argument("--batches", nargs="+", type=int, default=[256, 4096])
    p.add_argument("--min-time", type=float, default=0.3, help="seconds per timed block")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--scale", type=float, default=1.0, help="capacity multiplier (quick runs)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = run(a.kinds, a.batches, a.min_time, a.repeats, a.scale)
    ratios, summary = summarize(rows)
    for e in ratios:
        print(
            f"{e['transition']:>6} b={e['batch']:<5} {e['op']:<6} "
            + " ".join(f"{k}={v:,.0f}" for k, v in e.items() if k.endswith("_per_s"))
            + "  "
            + " ".join(f"{k}={v:.2f}" for k, v in e.items() if k.startswith("vs_"))
        )
    emit("store", ratios, summary, threads=1)


if __name__ == "__main__":
    main(__import__("sys").argv[1:])
