"""The latency benchmark's workload: what is put, what the learner computes, what is compared.

Atari-like transitions (:func:`make_batch`, 56 KB an item); the learner, an MLP over the first
bytes of each observation (:class:`Learner`), or the same duration spent off the host CPU
(:class:`OffCpuLearner`, a stand-in for a GPU backward); one learner step (:func:`train_step`);
and the settings ``bench latency`` compares: the put kinds (:data:`PUTS`) and the schedules
(:data:`MODES`).
"""

from __future__ import annotations

import itertools
import time

import torch
from torch import nn

# put kind -> (donate=, the put kind whose calibration sizes the round). Each kind's round is sized
# to the learner's compute with its own put; "copying_same_volume" puts the donated volume with a
# copying put (the neutral comparison: the same bytes per iteration as "donated").
PUTS = {
    "donated": (True, "donated"),
    "copying": (False, "copying"),
    "copying_same_volume": (False, "donated"),
}
MODES = ("sync", "overlap")
OBS_BYTES = 4 * 84 * 84  # the learner reads its features from these


def make_batch(n: int, seed: int) -> dict[str, torch.Tensor]:
    """``n`` Atari-like transitions (uint8 4x84x84 frames), the same for the same ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return {
        "obs": torch.randint(0, 256, (n, 4, 84, 84), dtype=torch.uint8, generator=g),
        "next_obs": torch.randint(0, 256, (n, 4, 84, 84), dtype=torch.uint8, generator=g),
        "action": torch.randint(0, 6, (n,), generator=g),
        "reward": torch.randn(n, generator=g),
        "done": torch.zeros(n, dtype=torch.bool),
    }


class Learner(nn.Module):
    """An MLP over the first ``features`` bytes of each observation."""

    def __init__(self, features: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.features = features
        dims = [features] + [hidden] * layers
        mods: list[nn.Module] = []
        for a, b in itertools.pairwise(dims):
            mods += [nn.Linear(a, b), nn.ReLU()]
        mods.append(nn.Linear(hidden, 6))
        self.net = nn.Sequential(*mods)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = obs.reshape(obs.shape[0], -1)[:, : self.features].float() / 255.0
        return self.net(x)


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor]
) -> None:
    """One learner step on a fetched batch: forward, backward (DDP averages), optimizer."""
    q = model(batch["obs"]).gather(1, batch["action"].view(-1, 1)).squeeze(1)
    loss = nn.functional.smooth_l1_loss(q, batch["reward"])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


class OffCpuLearner(nn.Module):
    """A small MLP whose backward also waits ``seconds``, host CPU idle (a device stand-in)."""

    def __init__(self, features: int, seconds: float) -> None:
        super().__init__()
        self.mlp = Learner(features, 256, 1)
        self.seconds = seconds

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return _DeviceTime.apply(self.mlp(obs), self.seconds)


class _DeviceTime(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None
