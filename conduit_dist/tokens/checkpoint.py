"""Token-plane checkpoints: every rank's complete, not yet consumed groups, restored whole onto
any world size.

``save_shard`` writes ``root/tokens-rank<r>.pt`` (plain tensors, loaded with
``weights_only=True``); after every rank wrote, rank 0 writes ``root/tokens-manifest.json``
last, so a directory without it is a torn checkpoint. ``load_shares`` reads every old rank's
file, lists the groups in (old rank, arrival) order and gives group ``j`` to new rank
``j % world``. Groups still being generated when the checkpoint was taken are not kept: their
producers' generation is lost with the job, so they would never complete.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import torch

from conduit_dist.errors import CheckpointError
from conduit_dist.tokens.spec import Packed

MANIFEST = "tokens-manifest.json"


def _barrier(ex, tag: int) -> None:
    ex.all_gather_start(torch.tensor([tag], dtype=torch.int64), -1).wait()


def save_shard(root: str, rank: int, world: int, state: dict, ex, group: str, size: int) -> None:
    """Write this rank's state (complete groups only: ``group`` field, ``size`` members);
    rank 0 adds the manifest once every rank has written."""
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    if rank == 0:  # an earlier manifest must not vouch for this checkpoint's files
        (path / MANIFEST).unlink(missing_ok=True)
    _barrier(ex, 0)
    tmp = path / f"tokens-rank{rank}.pt.tmp"
    torch.save(_complete_only(state, group, size), tmp)
    os.replace(tmp, path / f"tokens-rank{rank}.pt")
    _barrier(ex, 1)
    if rank == 0:
        manifest = {"world": world, "round": int(state["round"]), "version": state["version"]}
        (path / MANIFEST).write_text(json.dumps(manifest))
    _barrier(ex, 2)


def _complete_only(state: dict, group: str, size: int) -> dict:
    """``state`` without the sequences of groups still waiting for members."""
    store, out = state["store"], dict(state)
    gid = store["keys"]  # the shard's group keys (ids repeat across ranks after a restore)
    ids, counts = gid.unique(return_counts=True)
    keep = torch.isin(gid, ids[counts == size])
    tok_keep = torch.repeat_interleave(keep, store["lengths"])
    out["store"] = {
        "fixed": {n: c[keep] for n, c in store["fixed"].items()},
        "ragged": {n: a[tok_keep] for n, a in store["ragged"].items()},
        "lengths": store["lengths"][keep],
        "versions": store["versions"][keep],
        "keys": store["keys"][keep],
        "priority": store["priority"][keep],
        "evicted": store["evicted"],
    }
    return out


def load_shares(root: str, rank: int, world: int, plane, ex) -> None:
    """Load this rank's share of a checkpoint into ``plane`` (see the module docstring).

    Raises:
        CheckpointError: no manifest (torn or missing), a missing rank file, or a spec that
            differs from the plane's.
    """
    path = Path(root)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"restore: no complete token checkpoint under {root} ({exc})"
        ) from exc
    states = []
    for r in range(int(manifest["world"])):
        f = path / f"tokens-rank{r}.pt"
        if not f.exists():
            raise CheckpointError(
                f"restore: {f} is missing (manifest says world {manifest['world']})"
            )
        states.append(torch.load(f, weights_only=True))
    want = repr(plane.spec.state_dict())
    for r, s in enumerate(states):
        if s.get("spec") != want:
            raise CheckpointError(
                f"restore: rank {r}'s file holds spec {s.get('spec')}, expected this plane's {want}"
            )
    stores = [s["store"] for s in states]
    for r in range(world):  # every rank checks every share: all raise alike, none waits
        share = _deal(stores, r, world, plane.spec.group)
        n, tokens = int(share["lengths"].numel()), int(share["lengths"].sum())
        if n > plane.store.cap_items or tokens > plane.store.cap_tokens:
            raise CheckpointError(
                f"restore: rank {r}'s share ({n} sequences, {tokens} tokens) exceeds a shard's "
                f"capacity ({plane.store.cap_items} / {plane.store.cap_tokens}); restore onto "
                "more ranks or a larger plane"
            )
        if r == rank:
            mine = share
    plane.store.load_state_dict(mine)
    plane.engine.updates.clear()  # keys of the old shard mean nothing now
    plane.engine.round = max(int(s["round"]) for s in states)
    plane.version = max(int(s["version"]) for s in states)
    plane.newest = max(int(s["newest"]) for s in states)
    started = sum(int(s["started"]) for s in states)
    producers = max(1, plane.pacer.producers)
    plane.pacer.started = -(-started // producers)  # this producer's share, rounded up
    plane.restore_ledger([s.get("ledger", {}) for s in states])  # attached producers'
    _barrier(ex, 3)


def _deal(stores: list[dict], rank: int, world: int, group: str) -> dict:
    """This rank's groups: group ``j`` of the old shards' (rank, arrival) order, ``j % world``."""
    pieces = {"fixed": {}, "ragged": {}, "lengths": [], "versions": [], "keys": [], "priority": []}
    j = 0
    for st in stores:
        gid, lengths = st["keys"], st["lengths"]
        if gid.numel() == 0:
            continue
        starts = torch.cumsum(lengths, 0) - lengths
        change = torch.ones_like(gid, dtype=torch.bool)
        change[1:] = gid[1:] != gid[:-1]
        bounds = [*torch.nonzero(change).flatten().tolist(), gid.numel()]
        for a, b in itertools.pairwise(bounds):
            if j % world == rank:
                t0, t1 = int(starts[a]), int(starts[b - 1] + lengths[b - 1])
                for n, c in st["fixed"].items():
                    pieces["fixed"].setdefault(n, []).append(c[a:b])
                for n, c in st["ragged"].items():
                    pieces["ragged"].setdefault(n, []).append(c[t0:t1])
                pieces["lengths"].append(lengths[a:b])
                pieces["versions"].append(st["versions"][a:b])
                pieces["keys"].append(torch.full((b - a,), j, dtype=torch.int64))
                pieces["priority"].append(st["priority"][a:b])
            j += 1
    if not pieces["lengths"]:
        empty = stores[0]
        return {
            "fixed": {n: c[:0] for n, c in empty["fixed"].items()},
            "ragged": {n: c[:0] for n, c in empty["ragged"].items()},
            "lengths": empty["lengths"][:0],
            "versions": empty["versions"][:0],
            "keys": empty["keys"][:0],
            "priority": empty["priority"][:0],
            "evicted": torch.zeros(2, dtype=torch.int64),
        }
    return {
        "fixed": {n: torch.cat(v) for n, v in pieces["fixed"].items()},
        "ragged": {n: torch.cat(v) for n, v in pieces["ragged"].items()},
        "lengths": torch.cat(pieces["lengths"]),
        "versions": torch.cat(pieces["versions"]),
        "keys": torch.cat(pieces["keys"]),
        "priority": torch.cat(pieces["priority"]),
        "evicted": torch.zeros(2, dtype=torch.int64),
    }


__all__ = ["Packed", "load_shares", "save_shard"]
