"""Restoring a checkpoint onto the same or another world size and tier layout.

Every rank reads the manifest and computes the same plan: which old shards' items each new
shard takes, oldest first (:func:`plan`). On the same world size each rank takes its own old
shard back under the same generations, so fetched ``_index`` addresses and queued priority
updates stay valid. On another world size the items are dealt out again: whole old shards when
the sampler links items into episodes (no episode is cut), else contiguous, balanced runs of
the concatenated shards; each new shard's items are renumbered past every old generation, so
an address fetched before the restore never matches a new item. A new shard that is offered
more than its capacity keeps the newest items of each old shard, evenly, and counts the rest
(``store_stats()["restore_dropped"]``). The new shard is then refilled through ``append`` (the
tier layout may differ) and the sampler re-derives its per-item state (sum tree, stream links)
from the items, with the saved per-item state (masses) put back on top.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from conduit_dist.checkpoint import files
from conduit_dist.checkpoint.state import quiet_for_restore
from conduit_dist.errors import CheckpointError, ConfigError
from conduit_dist.sampling.base import KeepsItemState, Streams

Piece = tuple[int, int, int]  # (old rank, first item, end item): oldest first within a shard


def plan(counts: list[int], world: int, capacity: int, whole: bool) -> list[list[Piece]]:
    """Pieces each of ``world`` new shards takes from old shards of ``counts`` items.

    Args:
        counts: items on each old shard.
        world: new world size.
        capacity: items a new shard holds.
        whole: keep each old shard on one new shard (episodes), dealt round robin.

    Returns:
        ``[new rank] -> [(old rank, start, end), ...]`` in append order, within capacity.
    """
    old = len(counts)
    offered: list[list[Piece]] = [[] for _ in range(world)]
    if world == old:
        for j, n in enumerate(counts):
            offered[j].append((j, 0, n))
    elif whole:
        for j, n in enumerate(counts):
            offered[j % world].append((j, 0, n))
    else:  # balanced runs of the concatenation
        total = sum(counts)
        bounds = [total * r // world for r in range(world + 1)]
        starts = np.concatenate([[0], np.cumsum(counts)]).tolist()
        for r in range(world):
            lo, hi = bounds[r], bounds[r + 1]
            for j, n in enumerate(counts):
                a, b = max(lo, starts[j]), min(hi, starts[j] + n)
                if b > a:
                    offered[r].append((j, a - starts[j], b - starts[j]))
    return [_fit(pieces, capacity) for pieces in offered]


def _fit(pieces: list[Piece], capacity: int) -> list[Piece]:
    """Keep at most ``capacity`` items: the newest of each piece, as evenly as possible."""
    sizes = [b - a for _, a, b in pieces]
    if sum(sizes) <= capacity:
        return pieces
    keep = [0] * len(pieces)
    left = capacity
    order = sorted(range(len(pieces)), key=lambda i: sizes[i])
    for k, i in enumerate(order):  # water-filling: small pieces whole, the rest evenly
        share = left // (len(order) - k)
        keep[i] = min(sizes[i], share)
        left -= keep[i]
    return [(j, b - keep[i], b) for i, (j, _, b) in enumerate(pieces) if keep[i]]


def find(path: str, exchange, check) -> tuple[str, dict]:
    """The checkpoint to restore: ``path`` itself, or the newest complete one under it that
    ``check(candidate, manifest)`` passed on every rank (a torn or corrupted one is skipped: the
    previous is used).

    Raises:
        CheckpointError: when there is none.
    """
    if os.path.exists(os.path.join(path, "manifest.json")):
        candidates = [path]
    else:
        candidates = files.complete(path)
    problems = []
    for cand in candidates:
        try:
            man = files.read_manifest(cand)
            check(cand, man)
            ok, why = 1, ""
        except CheckpointError as e:
            ok, why, man = 0, str(e), None
        votes = exchange.all_gather_start(torch.tensor([ok]), -1).wait()[:, 0].tolist()
        if all(votes):
            return cand, man
        problems.append(
            why or f"{cand}: rejected by ranks {[j for j, v in enumerate(votes) if not v]}"
        )
    raise CheckpointError(
        f"restore: no complete checkpoint at {path!r}"
        + (f"; rejected: {'; '.join(problems)}" if problems else "")
    )


def restore(parts, spec, path: str) -> tuple[dict, int]:
    """Restore onto this plane (collective). Returns ``(this rank's extra, items dropped
    here)``; ``extra`` is old rank ``rank``'s, or old rank 0's when there was none.

    Raises:
        CheckpointError: no complete checkpoint, or a torn one named.
        ConfigError: another spec, or items staged here.
    """
    ex, shard, sampler = parts.exchange, parts.storage, parts.sampler
    quiet_for_restore(parts, "restore")
    whole = isinstance(sampler, Streams)  # whole old shards: no stream is cut
    items = isinstance(sampler, KeepsItemState)

    def check(cand: str, man: dict) -> None:
        """Every old rank's small state (all are read) and the items this rank takes."""
        files.verify(cand, man, range(man["world"]), kinds=("meta",))
        counts = [s["count"] for s in man["shards"]]
        pieces = plan(counts, ex.world, shard.capacity, whole)[ex.rank]
        files.verify(cand, man, sorted({j for j, _, _ in pieces}), kinds=("items",))

    path, man = find(path, ex, check)
    old = man["world"]
    metas = [torch.load(os.path.join(path, f"shard{j}.pt"), weights_only=True) for j in range(old)]
    if metas[0]["spec"] != spec.state_dict():
        raise ConfigError(f"spec: checkpoint has {metas[0]['spec']}, plane has {spec.state_dict()}")
    _check_fits(metas, shard, sampler)
    counts = [int(m["count"]) for m in metas]
    layout = plan(counts, ex.world, shard.capacity, whole)
    exact = old == ex.world
    if exact:
        base = [int(metas[r]["written"]) - sum(b - a for _, a, b in layout[r]) for r in range(old)]
    else:
        base = [max(int(m["written"]) for m in metas)] * ex.world
    shard.reset(base[ex.rank])
    if items:
        sampler.restore_begin(base[ex.rank])
    rb = int(metas[0]["record_bytes"])
    for j, a, b in layout[ex.rank]:
        records = _read_items(os.path.join(path, f"shard{j}.items"), rb, a, b)
        first = int(shard.written)
        shard.append(records)
        if items:
            gens = torch.arange(first, int(shard.written), dtype=torch.int64)
            saved = {k: v[a:b] for k, v in metas[j]["sampler_items"].items()}
            sampler.restore_piece(gens, saved)
    sizes = np.array([sum(b - a for _, a, b in pieces) for pieces in layout], dtype=np.int64)
    written = np.array(base, dtype=np.int64) + sizes
    sampler.restore_state([m["sampler"] for m in metas], exact, ex.rank, written)
    own = metas[ex.rank] if ex.rank < old else metas[0]
    parts.engine.restore(sizes, int(own["engine"]["ingested"]))
    if exact:  # this rank's own counters and positions
        for name in ("placement", "ages", "stager", "control"):
            getattr(parts, name).load_state_dict(own[name])
    if parts.limiter is not None and "limiter" in own:  # global counts
        parts.limiter.load_state_dict(own["limiter"])
    received = max(int(m["versions"]["received"]) for m in metas)
    parts.versions.load_state_dict(own["versions"], received=received)
    parts.weights.load_state_dict(own["weights"])
    parts.clock.load_state_dict({**own["clock"], "round": int(man["round"])})
    # every rank has read its files: checkpoints of a later round belong to the timeline left
    # behind (they would outrank the ones this run writes next), so rank 0 sets them aside
    ex.barrier("restore: files read", parts.clock.round)
    if ex.rank == 0:
        files.set_aside(os.path.dirname(path), int(man["round"]))
    dropped = counts[ex.rank] - int(sizes[ex.rank]) if exact else 0
    if not exact and ex.rank == 0:
        dropped = sum(counts) - int(sizes.sum())
    return own["extra"], dropped


def _check_fits(metas: list[dict], shard, sampler) -> None:
    """Refuse, before the shard is touched, a checkpoint of another record layout or sampler.

    Raises:
        ConfigError: naming what differs.
    """
    m = metas[0]
    if int(m["record_bytes"]) != shard.tiers[0].record_bytes:
        raise ConfigError(
            f"restore: checkpoint records are {m['record_bytes']} bytes, this plane stores "
            f"{shard.tiers[0].record_bytes} (another sampler's trailer or sequence layout?)"
        )
    for s in metas:
        sampler.check_state(s["sampler"])


def _read_items(path: str, record_bytes: int, a: int, b: int) -> torch.Tensor:
    """Items ``[a, b)`` of an items file (``uint8 [b - a, record_bytes]``)."""
    out = torch.empty((b - a, record_bytes), dtype=torch.uint8)
    with open(path, "rb") as f:
        f.seek(a * record_bytes)
        got = f.readinto(memoryview(out.numpy()).cast("B"))
    if got != out.numel():
        raise CheckpointError(f"restore: {path} ended after {got} of {out.numel()} bytes")
    return out
