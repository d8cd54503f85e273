"""Memory and disk tiers and the per-rank shard (one tier or several): the plane's storage."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from conduit_dist.collectives.dist import resolve_device
from conduit_dist.errors import ConfigError
from conduit_dist.tiers.base import Storage, Tier
from conduit_dist.tiers.disk import DiskTier
from conduit_dist.tiers.memory import MemoryTier
from conduit_dist.tiers.shard import Shard
from conduit_dist.tiers.tiered import TieredShard

KINDS = ("device", "pinned", "host", "disk")


_NEEDS_CUDA = {
    "device": "CUDA device memory",
    "pinned": "CUDA (page-locked host memory is pinned for CUDA copies)",
}


def check_tier(kind: str, slots: object, disk_dir: str | None) -> None:
    """Refuse a tier that cannot be built here, before anything is allocated.

    Args:
        kind: the tier's kind.
        slots: records it would hold.
        disk_dir: directory of ``disk`` tiers.

    Raises:
        ConfigError: on an unknown kind, a non-positive size, a disk tier without ``disk_dir``,
            or a device/pinned tier on a machine without CUDA (naming the kind, what it needs and
            what was found).
    """
    if kind not in KINDS:
        raise ConfigError(f"tiers: expected kinds from {list(KINDS)}, got {kind!r}")
    if not isinstance(slots, int) or slots < 1:
        raise ConfigError(f"tiers: {kind} tier needs an int >= 1 items, got {slots!r}")
    if kind == "disk" and not disk_dir:
        raise ConfigError("disk_dir: a disk tier needs a directory, got None")
    if kind in _NEEDS_CUDA and not torch.cuda.is_available():
        raise ConfigError(
            f"tiers: a {kind!r} tier expects {_NEEDS_CUDA[kind]}, found no CUDA here "
            f"(torch.cuda.is_available() is False; torch {torch.__version__}, built with CUDA "
            f"{torch.version.cuda}); use 'host' or 'disk' tiers on this machine, or a CUDA build "
            "of torch"
        )


def tier_cuda(device: torch.device) -> torch.device:
    """The CUDA device of this rank's device and pinned tiers, resolved once: the plane's own
    (already ``cuda:<index>``) on a CUDA plane, else ``resolve_device("cuda")``, from the
    visible devices and ``LOCAL_RANK`` (a bare ``"cuda"`` would put every rank's tier on the
    current device, GPU 0).

    Raises:
        ConfigError: without CUDA, or an index past the visible devices.
    """
    return resolve_device(device if device.type == "cuda" else "cuda")


def make_tier(
    kind: str,
    slots: int,
    record_bytes: int,
    device: torch.device,
    disk_dir,
    gbps: Mapping[str, Sequence[float]] | None = None,
    measure: bool = True,
) -> Tier:
    """One tier of ``slots`` records, its read/write bandwidth declared or measured.

    Args:
        kind: ``device``, ``pinned``, ``host`` or ``disk``.
        slots: records it holds.
        record_bytes: bytes per record.
        device: the plane's device (a ``device`` tier is on it when it is CUDA, else on this
            rank's GPU: :func:`tier_cuda`).
        disk_dir: directory of ``disk`` tiers.
        gbps: ``kind -> (read, write)`` GB/s from config; kinds not listed are calibrated.
        measure: calibrate when not declared (``False``: leave the bandwidths unknown).

    Returns:
        The tier, empty.

    Raises:
        ConfigError: as :func:`check_tier`, or on a malformed declared bandwidth.
    """
    check_tier(kind, slots, disk_dir)
    if kind == "disk":
        tier: Tier = DiskTier(slots, record_bytes, disk_dir)
    elif kind == "device":
        tier = MemoryTier(slots, record_bytes, tier_cuda(device))
    elif kind == "pinned":  # page-locked under this rank's GPU's context, not GPU 0's
        with torch.cuda.device(tier_cuda(device)):
            tier = MemoryTier(slots, record_bytes, "cpu", pin_memory=True)
    else:
        tier = MemoryTier(slots, record_bytes, "cpu")
    declared = (gbps or {}).get(kind)
    try:
        if declared is not None:
            if len(declared) != 2:
                raise ConfigError(
                    f"tier_gbps[{kind!r}]: expected [read, write] GB/s, got {list(declared)}"
                )
            tier.declare(*declared)
        elif measure:
            tier.calibrate()
    except Exception:
        tier.close()
        raise
    return tier


def make_shard(
    tiers,
    capacity: int,
    record_bytes: int,
    device: torch.device,
    disk_dir=None,
    background: bool = True,
    gbps: Mapping[str, Sequence[float]] | None = None,
):
    """The shard of one rank: one memory tier on ``device`` by default, else the given tiers.

    ``background``: a multi-tier shard demotes between rounds on a worker thread. ``gbps``:
    declared ``kind -> (read, write)`` GB/s; other configured tiers measure theirs at start-up
    (the default single tier does not: nothing would use the numbers, and every plane would pay).

    Returns:
        A ``Shard`` (no tiers given) or a ``TieredShard``.

    Raises:
        ConfigError: if the tiers' items do not add up to ``capacity``, or a tier cannot be
            built here (:func:`check_tier`; checked before any is built).
    """
    if tiers is None:
        kind = "device" if device.type == "cuda" else "host"
        return Shard(make_tier(kind, capacity, record_bytes, device, disk_dir, gbps, measure=False))
    tiers = [tuple(t) for t in tiers]
    total = sum(int(n) for _, n in tiers)
    if total != capacity:
        raise ConfigError(
            f"tiers: items per tier {[n for _, n in tiers]} add up to {total}, expected "
            f"capacity_per_rank={capacity}"
        )
    for kind, n in tiers:  # every tier checked before any is built: a refusal leaves nothing
        check_tier(kind, int(n), disk_dir)
    built: list[Tier] = []
    try:
        for kind, n in tiers:
            built.append(make_tier(kind, int(n), record_bytes, device, disk_dir, gbps))
        return TieredShard(built, background=background)
    except Exception:
        for t in built:
            t.close()
        raise


@dataclass(frozen=True)
class Tiers:
    """The storage of every rank's shard: memory and disk tiers, fastest first.

    Newest items live in the first tier; older ones are demoted down the list, and the last tier
    evicts its oldest. Pass as ``DataPlane(..., storage=cd.Tiers([("host", 250_000), ("disk",
    750_000)], disk_dir="/scratch"))``.

    Args:
        tiers: ``(kind, items)`` per tier with kinds ``device``, ``pinned``, ``host``, ``disk``;
            the items must add up to the plane's ``capacity_per_rank``. ``None``: one memory tier
            on the plane's device.
        disk_dir: directory for ``disk`` tiers (files removed on close).
        gbps: declared ``kind -> (read, write)`` GB/s; configured tiers of kinds not listed
            measure theirs at start-up (shown in ``store_stats``).
        background: with several tiers, demote between rounds on a worker thread (evicting up to
            one round's inflow early once full; see ``tiers/tiered.py``) instead of inside the
            round that needs the room.
    """

    tiers: Sequence[tuple[str, int]] | None = None
    disk_dir: str | None = None
    gbps: Mapping[str, Sequence[float]] | None = None
    background: bool = True

    def first_device(self, device: torch.device) -> torch.device | None:
        """Where the first tier's slots would live on a plane on ``device`` (no GPU needed):
        ``None`` for the default single tier (placed with the rows, ``plan_devices``), ``device``
        for a ``device`` tier on a CUDA plane, else the host (pinned, host and disk tiers; a
        ``device`` tier on a CPU plane goes to this rank's GPU, not where rows are composed)."""
        if not self.tiers:
            return None
        kind = str(self.tiers[0][0])
        if kind == "device":
            return device if device.type == "cuda" else torch.device("cuda")
        return torch.device("cpu")

    def build(self, capacity: int, record_bytes: int, device: torch.device):
        """This rank's shard (see :func:`make_shard`)."""
        return make_shard(
            self.tiers, capacity, record_bytes, device, self.disk_dir, self.background, self.gbps
        )


__all__ = [
    "KINDS",
    "DiskTier",
    "MemoryTier",
    "Shard",
    "Storage",
    "Tier",
    "TieredShard",
    "Tiers",
    "check_tier",
    "make_shard",
    "make_tier",
    "tier_cuda",
]
