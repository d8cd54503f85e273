"""Memory and disk tiers, the per-rank shard (one tier or several) and placement."""

from __future__ import annotations

import torch

from conduit_dist.errors import ConfigError
from conduit_dist.tiers.base import Tier
from conduit_dist.tiers.disk import DiskTier
from conduit_dist.tiers.memory import MemoryTier
from conduit_dist.tiers.placement import POLICIES, plan_ingest
from conduit_dist.tiers.shard import Shard
from conduit_dist.tiers.tiered import TieredShard

KINDS = ("device", "pinned", "host", "disk")


def make_tier(kind: str, slots: int, record_bytes: int, device: torch.device, disk_dir) -> Tier:
    """One tier of ``slots`` records.

    Raises:
        ConfigError: on an unknown kind, a non-positive size, a disk tier without ``disk_dir``,
            or a device/pinned tier without CUDA.
    """
    if kind not in KINDS:
        raise ConfigError(f"tiers: expected kinds from {list(KINDS)}, got {kind!r}")
    if not isinstance(slots, int) or slots < 1:
        raise ConfigError(f"tiers: {kind} tier needs an int >= 1 items, got {slots!r}")
    if kind == "disk":
        if not disk_dir:
            raise ConfigError("disk_dir: a disk tier needs a directory, got None")
        return DiskTier(slots, record_bytes, disk_dir)
    if kind == "device":
        return MemoryTier(slots, record_bytes, device if device.type == "cuda" else "cuda")
    return MemoryTier(slots, record_bytes, "cpu", pin_memory=kind == "pinned")


def make_shard(tiers, capacity: int, record_bytes: int, device: torch.device, disk_dir=None):
    """The shard of one rank: one memory tier on ``device`` by default, else the given tiers.

    Raises:
        ConfigError: if the tiers' items do not add up to ``capacity``.
    """
    if tiers is None:
        return Shard(MemoryTier(capacity, record_bytes, device))
    tiers = [tuple(t) for t in tiers]
    total = sum(int(n) for _, n in tiers)
    if total != capacity:
        raise ConfigError(
            f"tiers: items per tier {[n for _, n in tiers]} add up to {total}, expected "
            f"capacity_per_rank={capacity}"
        )
    built: list[Tier] = []
    try:
        for kind, n in tiers:
            built.append(make_tier(kind, int(n), record_bytes, device, disk_dir))
    except Exception:
        for t in built:
            t.close()
        raise
    return TieredShard(built)


__all__ = [
    "KINDS",
    "POLICIES",
    "DiskTier",
    "MemoryTier",
    "Shard",
    "Tier",
    "TieredShard",
    "make_shard",
    "make_tier",
    "plan_ingest",
]
