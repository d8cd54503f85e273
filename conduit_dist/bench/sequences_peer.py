"""TorchRL's ``SliceSampler``, timed for ``bench sequences`` in the peer's own interpreter.

Run by ``python -m conduit_dist.bench sequences`` as ``PEER_PYTHON sequences_peer.py SPEC_JSON``
(imports only torch, tensordict and torchrl; see ``per_peer.py``). The store holds whole
episodes back to back (TorchRL's layout: ``traj_key`` marks each episode), filled to each size,
then ``rb.sample()`` of ``B * T`` items (``B`` slices of ``T``) is timed. Prints one JSON line:
seconds per sample per store size.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer, SliceSampler


def main() -> None:
    """Fill a ``ReplayBuffer`` with episodes, then time ``sample``."""
    cfg = json.loads(sys.argv[1])
    torch.set_num_threads(cfg["threads"])
    g = torch.Generator().manual_seed(0)
    out = {"torch": torch.__version__}
    b, t = cfg["slices"], cfg["length"]
    for n in cfg["sizes"]:
        rb = ReplayBuffer(
            storage=LazyTensorStorage(n),
            sampler=SliceSampler(slice_len=t, traj_key="episode", strict_length=True),
            batch_size=b * t,
        )
        chunk, episode = 1 << 20, 0
        for at in range(0, n, chunk):
            k = min(chunk, n - at)
            lengths = torch.randint(t, 4 * cfg["episode"], (k // t + 1,), generator=g)
            ids = torch.repeat_interleave(torch.arange(lengths.numel()) + episode, lengths)[:k]
            episode += lengths.numel()
            data = {"obs": torch.randn(k, cfg["obs"], generator=g), "episode": ids}
            data["reward"] = torch.randn(k, generator=g)
            rb.extend(TensorDict(data, batch_size=[k]))
        for _ in range(3):
            rb.sample()
        times = []
        for _ in range(cfg["repeats"]):
            k, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < cfg["min_time"] or k < 2:
                rb.sample()
                k += 1
            times.append((time.perf_counter() - t0) / k)
        out[str(n)] = statistics.median(times)
        del rb
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
