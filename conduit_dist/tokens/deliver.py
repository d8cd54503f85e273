"""A token round's delivery: holders pack their selected groups per learner, learners cut the
received sections into micro-batches (``tokens/round.py`` runs the exchange between them).

Both sides work on whole columns with a handful of calls per column, whatever the number of
groups. The holder gathers each fixed column by one slot index for all its destinations; a
host shard copies the token columns as runs of adjacent arena tokens (a group's members, and
groups put together, lie side by side) in one native ``copy_spans`` call for every column and
destination, and a device shard (or a build without the extension) gathers them by one token
index. The holder's send buffer is the round's own (reused), or this rank's half of shared
memory where the transport's all-to-all goes through it (``Transport.lend``). The learner
splits each received column into its micro-batch runs with one ``torch.split`` per holder and
joins them with one ``cat``; where the sections come through shared memory it has the exchange
copy each run straight to its place in the joined columns instead (``land``, a scatter-receive:
no join copy).
"""

from __future__ import annotations

import math
from itertools import chain

import numpy as np
import torch

from conduit_dist.records.native import _native
from conduit_dist.tiers.cuda import upload
from conduit_dist.tokens import select as S
from conduit_dist.tokens.batch import MicroBatch
from conduit_dist.tokens.store import GroupStore
from conduit_dist.tokens.wire import KEYS, LENGTHS, VERSIONS, Wire


def pack(
    store: GroupStore,
    wire: Wire,
    send: torch.Tensor,
    gids: list[int],
    n: np.ndarray,
    t: np.ndarray,
    nbytes: np.ndarray,
) -> np.ndarray:
    """Write this holder's sections into ``send`` (on the store's device: its arenas').

    Args:
        store: this rank's shard.
        wire: the section layout.
        send: the send buffer (uint8), ``nbytes.sum()`` bytes.
        gids: this holder's selected groups, destination by destination, each destination's in
            its micro-batch order.
        n, t: sequences and tokens per destination (in rank order).
        nbytes: bytes per destination.

    Returns:
        The sequences' lengths in the order packed (host int64: what the learners' cut needs
        on the host, sent beside device sections so that nothing is read back from a GPU).
    """
    groups = store.groups
    slots = np.fromiter(chain.from_iterable(groups[g].slots for g in gids), dtype=np.int64)
    dev = send.device
    idx = upload(torch.from_numpy(slots), dev)
    spans = dev.type == "cpu" and _native is not None and hasattr(_native, "copy_spans")
    tok = None if spans else upload(store.token_index(slots), dev)
    fixed_np = {
        LENGTHS: store.length[slots],
        VERSIONS: store.version[slots],
        KEYS: store.key[slots],
    }
    meta = {k: upload(torch.from_numpy(np.ascontiguousarray(v)), dev) for k, v in fixed_np.items()}
    s0 = t0 = b0 = 0
    bases: dict[str, list[int]] = {name: [] for name in store.arena}  # per destination
    for d in range(len(n)):
        s1, t1, b1 = s0 + int(n[d]), t0 + int(t[d]), b0 + int(nbytes[d])
        if s1 > s0:
            cols = wire.columns(send[b0:b1], s1 - s0, t1 - t0)
            for name, col in store.fixed.items():
                torch.index_select(col, 0, idx[s0:s1], out=cols[name])
            for name, values in meta.items():
                cols[name].copy_(values[s0:s1])
            for name, arena in store.arena.items():
                if tok is None:  # where token t0 of this destination's column would start
                    bases[name].append(cols[name].data_ptr() - t0 * _token_bytes(arena))
                else:
                    torch.index_select(arena, 0, tok[t0:t1], out=cols[name])
        else:
            for name in bases:
                bases[name].append(0)  # no run goes there
        s0, t0, b0 = s1, t1, b1
    if tok is None and len(slots):
        _copy_runs(store, slots, n, t, bases)
    return fixed_np[LENGTHS]


def _token_bytes(arena: torch.Tensor) -> int:
    """Bytes of one token of a (contiguous) arena column, its inner shape included."""
    return arena.stride(0) * arena.element_size()


def _copy_runs(
    store: GroupStore,
    slots: np.ndarray,
    n: np.ndarray,
    t: np.ndarray,
    bases: dict[str, list[int]],
) -> None:
    """Copy the tokens of ``slots`` (host arenas) into the packed columns as runs: adjacent
    sequences whose tokens are adjacent in the arena, within one destination, are one span;
    every column's spans go in one ``copy_spans`` call.

    Args:
        store: the host shard; slots: the sequences in packing order.
        n: sequences per destination (in rank order).
        t: tokens per destination: each destination's column holds exactly these.
        bases: per arena column, per destination, the address token 0 of the packing order
            would have in that destination's column (addresses computed, never dereferenced
            outside the column: each run lies inside its destination's tokens).

    Raises:
        RuntimeError: if the slots' lengths do not sum to ``t`` per destination (the columns
            were sized from the group table; raw copies must never leave them).
    """
    lengths = store.length[slots].astype(np.int64)
    starts = store.offset[slots].astype(np.int64)
    dest = np.repeat(np.arange(len(n)), n)
    held = np.bincount(dest, weights=lengths, minlength=len(n)).astype(np.int64)
    if not np.array_equal(held, np.asarray(t, dtype=np.int64)):
        raise RuntimeError(
            f"token delivery: the selected sequences hold {held.tolist()} tokens per "
            f"destination, the group table said {np.asarray(t).tolist()}; nothing was copied"
        )
    at = np.cumsum(lengths) - lengths  # each sequence's token position in packing order
    cut = np.ones(len(slots), dtype=bool)
    cut[1:] = (starts[1:] != starts[:-1] + lengths[:-1]) | (dest[1:] != dest[:-1])
    first = np.flatnonzero(cut)
    run_len = np.add.reduceat(lengths, first)
    run_src, run_at, run_dest = starts[first], at[first], dest[first]
    triples = []
    for name, arena in store.arena.items():
        item = _token_bytes(arena)
        base = np.asarray(bases[name], dtype=np.int64)[run_dest]
        triples.append(
            np.stack([base + run_at * item, arena.data_ptr() + run_src * item, run_len * item], 1)
        )
    _native.copy_spans(tuple(np.concatenate(triples).ravel().tolist()))


def _layout(
    groups: S.Groups, chosen: np.ndarray, holder: np.ndarray, mbs: list[list[int]], world: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Rows ``n`` and tokens ``t`` of micro-batch ``k`` from holder ``s`` (``[micro, world]``),
    and the selected positions in micro-batch order with each one's micro-batch."""
    members = groups.table[chosen, S.MEMBERS]
    tokens = groups.tokens[chosen]
    flat = np.fromiter((i for mb in mbs for i in mb), dtype=np.int64)
    k_of = np.repeat(np.arange(len(mbs)), [len(mb) for mb in mbs])
    n = np.zeros((len(mbs), world), np.int64)
    t = np.zeros((len(mbs), world), np.int64)
    np.add.at(n, (k_of, holder[flat]), members[flat])
    np.add.at(t, (k_of, holder[flat]), tokens[flat])
    return n, t, flat, k_of


def land(
    wire: Wire,
    groups: S.Groups,
    chosen: np.ndarray,
    holder: np.ndarray,
    mbs: list[list[int]],
    world: int,
) -> tuple[dict[str, torch.Tensor], dict[int, np.ndarray], tuple]:
    """Host columns for this learner's micro-batches, joined (fresh: the micro-batches own
    them), and per holder the runs that copy its section straight into them
    (``Transport.land``): micro-batch ``k``'s rows from holder ``s`` are one run of each of
    ``s``'s columns, landing at run ``(k, s)``'s place in micro-batch order. What :func:`cut`
    does with one more copy.

    Returns:
        The columns, the runs (``{holder: int64 [k, 3]}`` of destination address, offset in the
        holder's section, bytes) and the layout for :func:`landed`.
    """
    n, t, flat, k_of = _layout(groups, chosen, holder, mbs, world)
    full: dict[str, torch.Tensor] = {}
    runs: dict[int, list[np.ndarray]] = {s: [] for s in range(world)}
    sent = [s for s in range(world) if n[:, s].any()]  # holders with a section for it
    offsets = {s: wire.offsets(int(n[:, s].sum()), int(t[:, s].sum())) for s in sent}
    for name, (shape, dtype) in (*wire.fixed.items(), *wire.ragged.items()):
        m = t if name in wire.ragged else n
        col = full[name] = torch.empty((int(m.sum()), *shape), dtype=dtype)
        item = math.prod(shape) * dtype.itemsize
        flat_m = m.ravel()
        before = (np.cumsum(flat_m) - flat_m).reshape(m.shape)  # row-major: micro, then holder
        for s in sent:
            rows = m[:, s]
            src = offsets[s][name] + (np.cumsum(rows) - rows) * item
            keep = rows > 0
            runs[s].append(
                np.stack([col.data_ptr() + before[keep, s] * item, src[keep], rows[keep] * item], 1)
            )
    spans = {s: np.concatenate(r).astype(np.int64) for s, r in runs.items() if r}
    return full, spans, (n, t, flat, k_of)


def landed(
    wire: Wire,
    full: dict[str, torch.Tensor],
    layout: tuple,
    groups: S.Groups,
    chosen: np.ndarray,
    holder: np.ndarray,
    device: torch.device,
) -> list[MicroBatch]:
    """This learner's micro-batches from the columns :func:`land` had filled."""
    n, t, flat, k_of = layout
    return _finish(wire, full, n, t, flat, k_of, groups, chosen, holder, device, None)


def cut(
    wire: Wire,
    recv: torch.Tensor,
    sizes: np.ndarray,
    groups: S.Groups,
    chosen: np.ndarray,
    holder: np.ndarray,
    mbs: list[list[int]],
    device: torch.device,
    lengths: np.ndarray | None = None,
) -> list[MicroBatch]:
    """This learner's micro-batches from the received sections.

    A holder packs its groups in micro-batch order, so micro-batch ``k``'s rows from holder
    ``s`` are one contiguous run of each of ``s``'s columns: each column is split into runs
    (one ``torch.split`` per holder), the runs joined in micro-batch order (one ``cat``), and
    micro-batches are views of the result (one more ``split``). ``cu_seqlens`` and
    ``max_seqlen`` are computed on the host before the move to ``device`` (no device sync).
    (Host sections through shared memory skip the join: :func:`land`.)

    Args:
        wire: the section layout.
        recv: the received bytes, holder by holder.
        sizes: bytes received from each holder.
        groups: the round's group table; chosen: the selected rows; holder: each selected
            group's holder rank (indexed by position in ``chosen``).
        mbs: this learner's micro-batches (positions in ``chosen``).
        device: where the micro-batches go.
        lengths: the received sequences' lengths, holder by holder, on the host (sent beside
            sections on a device); ``None``: read from the received (host) sections.

    Returns:
        The micro-batches, in order.
    """
    world = len(sizes)
    n, t, flat, k_of = _layout(groups, chosen, holder, mbs, world)
    splits: dict[str, list] = {name: [] for name in (*wire.fixed, *wire.ragged)}
    host_lengths: list[list[np.ndarray]] = []
    at = seq_at = 0
    for src in range(world):
        ns, ts = n[:, src], t[:, src]
        cols = wire.columns(recv[at : at + int(sizes[src])], int(ns.sum()), int(ts.sum()))
        for name, col in cols.items():
            splits[name].append(torch.split(col, (ts if name in wire.ragged else ns).tolist()))
        if lengths is not None:
            mine = lengths[seq_at : seq_at + int(ns.sum())]
            host_lengths.append(np.split(mine, np.cumsum(ns)[:-1]))
            seq_at += int(ns.sum())
        at += int(sizes[src])
    runs = [(k, s) for k, s in zip(*np.nonzero(n))]  # row-major: micro-batch, then holder
    full = {name: torch.cat([parts[s][k] for k, s in runs]) for name, parts in splits.items()}
    host = None
    if lengths is not None and runs:  # the same runs of the host copy, in the same order
        host = np.concatenate([host_lengths[s][k] for k, s in runs]).astype(np.int64)
    elif lengths is not None:
        host = np.zeros(0, dtype=np.int64)
    return _finish(wire, full, n, t, flat, k_of, groups, chosen, holder, device, host)


def _finish(
    wire: Wire, full: dict[str, torch.Tensor], n: np.ndarray, t: np.ndarray, flat: np.ndarray,
    k_of: np.ndarray, groups: S.Groups, chosen: np.ndarray, holder: np.ndarray,
    device: torch.device, host: np.ndarray | None,
) -> list[MicroBatch]:  # fmt: skip
    """The micro-batches of joined columns ``full`` (``host``: the lengths on the host, or
    ``None``: read from the host column)."""
    members = groups.table[chosen, S.MEMBERS]
    order = flat[np.lexsort((holder[flat], k_of))]  # stable: each holder's micro-batch order
    owner = np.repeat(holder[order], members[order])  # each received sequence's, on the host
    keys = np.repeat(groups.table[chosen, S.GID][order], members[order])
    device_of = full[LENGTHS].device
    full["_holder"] = upload(torch.from_numpy(owner), device_of)
    if host is None:  # host sections: read where they landed
        host = full[LENGTHS].numpy()
    return _slice(wire, full, n.sum(1), t.sum(1), device, host, (keys, owner))


def _slice(
    wire: Wire, full, seqs: np.ndarray, toks: np.ndarray, device, lengths: np.ndarray,
    ids: tuple[np.ndarray, np.ndarray],
) -> list[MicroBatch]:  # fmt: skip
    """Micro-batches as views of ``full``, moved to ``device`` column by column (nothing moves
    where they are there already; host to CUDA without a host sync); ``lengths``: the
    sequences' lengths on the host, for ``cu_seqlens`` and ``max_seqlen``, and ``ids``: their
    keys and holders there (``MicroBatch.host``: no device read)."""
    ends = np.cumsum(seqs)
    starts = ends - seqs
    longest = np.maximum.reduceat(lengths, starts)
    cum = np.concatenate([[0], np.cumsum(lengths)])
    cu = np.concatenate([cum[a : b + 1] - cum[a] for a, b in zip(starts, ends)]).astype(np.int32)
    cus = torch.split(upload(torch.from_numpy(cu), device), (seqs + 1).tolist())
    ragged = tuple(wire.ragged)
    parts = {
        name: torch.split(upload(v, device), (toks if name in ragged else seqs).tolist())
        for name, v in full.items()
    }
    keys, holders = ids
    return [
        MicroBatch(
            {name: p[k] for name, p in parts.items()},
            cus[k],
            int(longest[k]),
            (k, len(seqs)),
            ragged,
            {
                "_key": keys[starts[k] : ends[k]],
                "_holder": holders[starts[k] : ends[k]],
                "tokens": np.asarray(toks[k]),
            },
        )
        for k in range(len(seqs))
    ]
