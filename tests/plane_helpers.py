"""Batches whose fields are functions of an item id, so any row can be checked for integrity."""

from __future__ import annotations

import torch


def make_batch(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    ids = ids.to(torch.int64)
    f = ids.to(torch.float64)
    return {
        "id": ids,
        "obs": torch.stack([f * 0.5, -f, f + 0.25], dim=1).float(),
        "reward": (f % 7).float(),
        "done": ids % 3 == 0,
        "frame": (ids[:, None] + torch.arange(5)[None, :]).remainder(251).to(torch.uint8),
    }


def assert_intact(batch: dict[str, torch.Tensor]) -> None:
    """Every field of every row equals what :func:`make_batch` gives for that row's id."""
    expected = make_batch(batch["id"])
    for k, v in expected.items():
        assert torch.equal(batch[k], v), f"field {k} corrupted"


def spec():
    from conduit_dist import ExperienceSpec

    return ExperienceSpec.from_batch(make_batch(torch.arange(2)))


def shard_items(plane) -> torch.Tensor:
    """Ids of the items this rank's shard holds."""
    recs = plane.shard.tier.data[: plane.shard.size]
    return plane.spec.unpack(recs)["id"].clone()


def fill(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Give every tensor of ``module``'s state distinct values from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in module.state_dict().values():
            if t.dtype.is_floating_point:
                t.copy_(torch.randn(t.shape, generator=g))
            else:
                t.copy_(torch.randint(0, 2 if t.dtype == torch.bool else 100, t.shape, generator=g))
    return module
