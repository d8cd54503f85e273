"""TorchRL's prioritized replay, timed for ``bench per`` in the peer's own interpreter.

Run by ``python -m conduit_dist.bench per`` as ``PEER_PYTHON per_peer.py SPEC_JSON``; imports
only torch, tensordict and torchrl (torchrl 0.14.1's ``PrioritizedSampler`` loads its C++
extension with torch 2.14.1, so it runs in a virtual environment of its own:
``scripts/peer_env.sh``). Prints one JSON line: seconds per sample + update step per batch size.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, PrioritizedSampler, TensorDictReplayBuffer


def _batch(shapes: dict[str, list[int]], n: int, g: torch.Generator) -> TensorDict:
    data = {k: torch.randn((n, *s), generator=g) for k, s in shapes.items()}
    data["action"] = torch.randint(0, 6, (n,), generator=g)
    data["reward"] = torch.randn(n, generator=g)
    data["done"] = torch.rand(n, generator=g) < 0.01
    return TensorDict(data, batch_size=[n])


def main() -> None:
    """Fill a ``ReplayBuffer`` to capacity, then time ``sample`` + ``update_priority``."""
    cfg = json.loads(sys.argv[1])
    torch.set_num_threads(cfg["threads"])
    g = torch.Generator().manual_seed(0)
    cap = cfg["capacity"]
    out = {"torch": torch.__version__}
    for b in cfg["batches"]:
        rb = TensorDictReplayBuffer(
            storage=LazyTensorStorage(cap),
            sampler=PrioritizedSampler(cap, alpha=cfg["alpha"], beta=cfg["beta"], eps=cfg["eps"]),
            batch_size=b,
        )
        for at in range(0, cap, 65536):
            rb.extend(_batch(cfg["shapes"], min(65536, cap - at), g))
        prio = torch.rand(b, generator=g) + 0.01

        def step(rb=rb, prio=prio) -> None:
            td = rb.sample()
            rb.update_priority(td["index"], prio)

        for _ in range(20):
            step()
        times = []
        for _ in range(cfg["repeats"]):
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < cfg["min_time"]:
                step()
                n += 1
            times.append((time.perf_counter() - t0) / n)
        out[str(b)] = statistics.median(times)
        del rb
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
