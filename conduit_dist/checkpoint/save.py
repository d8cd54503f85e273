"""Taking a checkpoint at a round boundary every rank agrees on, then writing it in the background.

The ranks meet in one small all-gather (their round, items staged, and rank 0's token naming
this attempt's directory); each then fixes its shard's live items (a copy-on-write snapshot, no
copy yet) and its small state (counters, sampler, versions, the caller's ``extra``: copied now,
a few KB to MB) and returns; a thread writes the rest while rounds continue (``writer.py``).
"""

from __future__ import annotations

import os
import random

import torch

from conduit_dist.checkpoint import files
from conduit_dist.checkpoint.snapshot import ShardSnapshot
from conduit_dist.checkpoint.state import parts_state
from conduit_dist.checkpoint.writer import Checkpoint
from conduit_dist.errors import CheckpointError, ConfigError
from conduit_dist.sampling.base import KeepsItemState

_PLAIN = (int, float, bool, str, type(None), torch.Tensor)


def begin(
    parts, spec, root: str, extra, *, rates: tuple[float, float], keep: int, timeout_s: float
) -> Checkpoint:
    """Agree on the round, snapshot this rank's shard and state, start writing (collective).

    The caller has waited for any running round. Returns the checkpoint in flight.

    Raises:
        CheckpointError: if ranks are at different rounds or some rank has staged items.
        ConfigError: if ``extra`` holds something ``torch.load(weights_only=True)`` refuses.
    """
    _check_extra(extra, "extra")
    ex, clock = parts.exchange, parts.clock
    r = clock.round
    token = random.getrandbits(62) if ex.rank == 0 else 0
    mine = torch.tensor([r, parts.stager.pending, token], dtype=torch.int64)
    seen = ex.all_gather_start(mine, r).wait().clone()
    rounds, pending = seen[:, 0].tolist(), seen[:, 1].tolist()
    if len(set(rounds)) != 1:
        raise CheckpointError(
            f"checkpoint: ranks are at different rounds {rounds} (by rank); call it at the "
            "same point on every rank"
        )
    if any(pending):
        raise CheckpointError(
            f"checkpoint: items staged since round {r} on ranks "
            f"{[j for j, n in enumerate(pending) if n]} ({pending}); run a round (fetch or "
            "flush) first, on every rank"
        )
    os.makedirs(root, exist_ok=True)
    ck = Checkpoint(root, r, int(seen[0, 2]), ex.rank, ex.world, int(parts.storage.size))
    if ck.complete:  # this round was checkpointed already (e.g. just restored)
        return ck
    snap = ShardSnapshot(parts.storage)
    try:
        meta = _meta(parts, spec, snap, extra, r)
    except BaseException:
        snap.close()  # the tiers stop copying
        raise
    ck.start(meta, snap, rates, keep, timeout_s)
    return ck


def _meta(parts, spec, snap: ShardSnapshot, extra, r: int) -> dict:
    """This rank's small state at the snapshot: its parts' state dicts (as ``state_dict``
    gives them, without the items), where its items are, per-item sampler state and the
    caller's ``extra`` (copied: the caller goes on changing its own)."""
    ex, storage, sampler = parts.exchange, parts.storage, parts.sampler
    gens = torch.arange(snap.oldest, snap.oldest + snap.count, dtype=torch.int64)
    # first: it brings the sampler up to date (received priority updates applied)
    items = sampler.item_state(gens) if isinstance(sampler, KeepsItemState) else {}
    return {
        **parts_state(parts, spec, storage=False),
        "format": files.FORMAT,
        "round": r,
        "rank": ex.rank,
        "world": ex.world,
        "oldest": snap.oldest,
        "count": snap.count,
        "written": int(storage.written),
        "capacity": int(storage.capacity),
        "record_bytes": int(storage.tiers[0].record_bytes),
        "layout": [[t.kind, int(t.slots)] for t in storage.tiers],
        "sampler_items": items,
        "extra": _copy(extra),
    }


def _copy(obj):
    """``obj`` with every tensor copied (the caller may change its own meanwhile)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _copy(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_copy(v) for v in obj)
    return obj


def _check_extra(obj, where: str) -> None:
    """``obj`` is tensors, numbers, strings and ``None`` in dicts, lists and tuples.

    Raises:
        ConfigError: naming the first entry that is not.
    """
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str | int):
                raise ConfigError(f"checkpoint {where}: expected str or int keys, got {k!r}")
            _check_extra(v, f"{where}[{k!r}]")
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            _check_extra(v, f"{where}[{i}]")
    elif not isinstance(obj, _PLAIN):
        raise ConfigError(
            f"checkpoint {where}: expected a tensor, number, string, None, dict, list or tuple "
            f"(what torch.load(weights_only=True) reads), got {type(obj).__name__}"
        )
