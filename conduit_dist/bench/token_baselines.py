"""``bench tokens``' workload and its three baselines (equal group counts, padding per
micro-batch, all-gather-then-repack), each handing the learner packed micro-batches with
``cu_seqlens`` as the token plane does (``bench/tokens.py`` measures them side by side).

Every baseline reuses its buffers from sample to sample, as the plane reuses its arenas: the
send and receive buffers and the micro-batches' field tensors come from a :class:`Pool`, sized
(and first touched) by the warm-up samples; a buffer grown after them is counted
(:attr:`Pool.grown`) and reported beside the figures."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from conduit_dist.tokens import balance

FIELDS = (("tokens", torch.int32), ("logprobs", torch.float32), ("loss_mask", torch.bool))
SEQ_FIELDS = (("_length", torch.int64), ("group", torch.int64), ("reward", torch.float32))
TOKEN_BYTES = sum(t.itemsize for _, t in FIELDS)  # 9
SEQ_BYTES = sum(t.itemsize for _, t in SEQ_FIELDS)  # 20
MAX_LEN = 8192
# torch 2.13 names it all_gather_single (all_gather_into_tensor is its deprecated alias)
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def align8(n: int) -> int:
    """``n`` rounded up to a multiple of 8."""
    return (n + 7) & ~7


def section_bytes(n: int, t: int) -> int:
    """Bytes of a packed section of ``n`` sequences and ``t`` token positions."""
    return align8(n * SEQ_BYTES + t * TOKEN_BYTES) if n else 0


class Pool:
    """Byte buffers reused from sample to sample, one per key, grown with headroom (and zeroed,
    i.e. first touched, when grown)."""

    HEADROOM = 2.0

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}
        self.grown = 0  # growths since the last reset_count()

    def get(self, key: str, nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A 1-D ``dtype`` tensor of ``nbytes // itemsize`` elements over the buffer ``key``
        (valid until the next ``get`` of that key)."""
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < nbytes:
            buf = torch.zeros(int(nbytes * self.HEADROOM) + 64, dtype=torch.uint8)
            self._bufs[key] = buf
            self.grown += 1
        return buf[:nbytes].view(dtype)

    def reset_count(self) -> None:
        self.grown = 0


class Data:
    """This rank's generated groups, packed, with helpers to pack any subset of them."""

    def __init__(self, rng: np.random.Generator, groups: int, size: int, median: float, base: int):
        n = groups * size
        lengths = np.clip(rng.lognormal(np.log(median), 1.0, n), 16, MAX_LEN).astype(np.int64)
        tail = rng.random(n) < 0.01
        lengths[tail] = rng.integers(6144, MAX_LEN + 1, int(tail.sum()))
        self.lengths = torch.as_tensor(lengths)
        total = int(self.lengths.sum())
        self.fields = {
            "tokens": torch.randint(0, 50_000, (total,), dtype=torch.int32),
            "logprobs": -torch.rand(total),
            "loss_mask": torch.rand(total) > 0.3,
        }
        self.reward = torch.rand(n)
        self.group = torch.arange(base, base + groups).repeat_interleave(size)
        self.size, self.groups = size, groups
        self.starts = torch.cumsum(self.lengths, 0) - self.lengths
        self.group_tokens = self.lengths.view(groups, size).sum(1)

    def batch(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return {**self.fields, "reward": self.reward, "group": self.group}, self.lengths

    def nbytes(self) -> int:
        return section_bytes(self.groups * self.size, int(self.lengths.sum()))

    def pack(
        self, groups: list[int] | None = None, pads: list[int] | None = None, out=None
    ) -> torch.Tensor:
        """``groups`` (local indices, in that order; ``None``: all, in order) as one byte
        buffer: lengths, group ids, rewards, then each token field (packed, or each sequence of
        group ``groups[i]`` padded with zeros to ``pads[i]`` positions), zeros to an 8-byte
        multiple (:func:`section_bytes`); written into ``out`` (a byte tensor of that size)
        where given."""
        if groups is None and pads is None:
            parts = [self.lengths, self.group, self.reward, *self.fields.values()]
        else:
            g = torch.arange(self.groups) if groups is None else torch.as_tensor(groups)
            if not len(g):
                return torch.zeros(0, dtype=torch.uint8)
            s = (g[:, None] * self.size + torch.arange(self.size)).reshape(-1)
            lengths = self.lengths[s]
            tok = torch.repeat_interleave(
                self.starts[s] - (torch.cumsum(lengths, 0) - lengths), lengths
            ) + torch.arange(int(lengths.sum()))
            parts = [lengths, self.group[s], self.reward[s]]
            if pads is not None:  # sequence i's tokens at offset[i] .. offset[i] + length[i]
                width = torch.as_tensor(pads, dtype=torch.int64).repeat_interleave(self.size)
                offset = torch.cumsum(width, 0) - width
                dest = torch.repeat_interleave(
                    offset - (torch.cumsum(lengths, 0) - lengths), lengths
                ) + torch.arange(int(lengths.sum()))
                for f in self.fields.values():
                    full = torch.zeros(int(width.sum()), dtype=f.dtype)
                    full[dest] = f[tok]
                    parts.append(full)
            else:
                parts += [f[tok] for f in self.fields.values()]
        raw = [p.view(torch.uint8) for p in parts]
        size = sum(p.numel() for p in raw)
        raw.append(torch.zeros(-size % 8, dtype=torch.uint8))
        return torch.cat(raw) if out is None else torch.cat(raw, out=out)


def unpack(buf: torch.Tensor, n: int, t: int) -> dict[str, torch.Tensor]:
    """Typed views of a section packed by :meth:`Data.pack` (``t`` token positions)."""
    out, at = {}, 0
    for name, dtype in SEQ_FIELDS:
        out[name] = buf[at : at + n * dtype.itemsize].view(dtype)
        at += n * dtype.itemsize
    for name, dtype in FIELDS:
        out[name] = buf[at : at + t * dtype.itemsize].view(dtype)
        at += t * dtype.itemsize
    return out


def _slice(full: dict, seqs: np.ndarray, toks: np.ndarray, pads: list[int] | None) -> list[dict]:
    """Micro-batches from each field's tensor in micro-batch order: ``seqs[k]`` sequences and
    ``toks[k]`` token positions each (``pads``: micro-batch ``k``'s token fields are
    ``[sequences, pads[k]]`` rows)."""
    seq_end, tok_end = np.cumsum(seqs), np.cumsum(toks)
    out = []
    for k in range(len(seqs)):
        s0, s1 = int(seq_end[k] - seqs[k]), int(seq_end[k])
        t0, t1 = int(tok_end[k] - toks[k]), int(tok_end[k])
        mb = {n: full[n][s0:s1] for n, _ in SEQ_FIELDS}
        mb |= {n: full[n][t0:t1] for n, _ in FIELDS}
        if pads is not None:
            mb |= {n: mb[n].view(-1, pads[k]) for n, _ in FIELDS}
        cu = torch.zeros(s1 - s0 + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(mb["_length"], 0)
        mb["cu_seqlens"] = cu
        out.append(mb)
    return out


def _cat(pool: Pool, name: str, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``torch.cat(parts)`` into the pooled buffer ``name``."""
    n = sum(p.numel() for p in parts)
    return torch.cat(parts, out=pool.get(name, n * dtype.itemsize, dtype))


def _counts(d: Data, world: int) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's group token counts and longest sequences, in one all-gather (rank-major:
    global group ``r * per + j``)."""
    mine = torch.stack([d.group_tokens, d.lengths.view(d.groups, d.size).max(1).values])
    out = torch.empty(world * 2 * d.groups, dtype=torch.int64)
    ALL_GATHER(out, mine.reshape(-1))
    out = out.view(world, 2, d.groups)
    return out[:, 0].reshape(-1).numpy(), out[:, 1].reshape(-1).numpy()


def _exchange(
    d: Data, pool: Pool, plan: list, tokens: np.ndarray, longest: np.ndarray | None = None
) -> tuple[list, int]:
    """Move the groups of ``plan[learner][micro] = [global group, ...]`` from their holders
    to their learners in one raw all-to-all (holders pack in micro-batch order into a pooled
    send buffer; every rank derives the byte matrix from the gathered ``tokens``), then cut
    this learner's micro-batches with one ``cat`` of runs per field into pooled tensors.
    ``longest`` (every group's longest sequence): each micro-batch's sequences are padded to
    its own longest, on the holders, before they move. Returns the micro-batches and the
    bytes received."""
    world, me, per, size = dist.get_world_size(), dist.get_rank(), d.groups, d.size
    pads = None  # pads[li][k]: micro-batch k of learner li's width
    if longest is not None:
        pads = [[int(longest[mb].max()) for mb in p] for p in plan]
    width = np.empty(world * per, np.int64)  # token positions each group takes on the wire
    for li, p in enumerate(plan):
        for k, mb in enumerate(p):
            width[mb] = tokens[mb] if pads is None else size * pads[li][k]
    g_all = np.concatenate([[g for mb in p for g in mb] for p in plan])
    dest = np.repeat(np.arange(world), [sum(len(mb) for mb in p) for p in plan])
    holder = g_all // per
    n = np.zeros((world, world), np.int64)  # sequences holder -> learner
    t = np.zeros((world, world), np.int64)  # token positions holder -> learner
    np.add.at(n, (holder, dest), size)
    np.add.at(t, (holder, dest), width[g_all])
    nbytes = np.vectorize(section_bytes)(n, t)
    in_splits, out_splits = nbytes[me].tolist(), nbytes[:, me].tolist()
    send = pool.get("send", sum(in_splits))
    at = 0
    for li in range(world):
        mine = [(g - me * per, k) for k, mb in enumerate(plan[li]) for g in mb if g // per == me]
        if mine:
            widths = None if pads is None else [pads[li][k] for _, k in mine]
            d.pack([g for g, _ in mine], widths, out=send[at : at + in_splits[li]])
        at += in_splits[li]
    recv = pool.get("recv", sum(out_splits))
    dist.all_to_all_single(recv, send, out_splits, in_splits)
    parts = torch.split(recv, out_splits)
    cols = [unpack(parts[s], int(n[s, me]), int(t[s, me])) for s in range(world)]
    mbs = plan[me]
    rn = np.zeros((len(mbs), world), np.int64)  # sequences of micro-batch k from holder s
    rt = np.zeros((len(mbs), world), np.int64)  # their token positions
    for k, mb in enumerate(mbs):
        g = np.asarray(mb)
        np.add.at(rn[k], g // per, size)
        np.add.at(rt[k], g // per, width[g])
    n0, t0 = np.cumsum(rn, 0) - rn, np.cumsum(rt, 0) - rt
    runs = [(k, s) for k in range(len(mbs)) for s in range(world) if rn[k, s]]
    full = {}
    for name, dtype in SEQ_FIELDS:
        got = [cols[s][name][n0[k, s] : n0[k, s] + rn[k, s]] for k, s in runs]
        full[name] = _cat(pool, name, got, dtype)
    for name, dtype in FIELDS:
        got = [cols[s][name][t0[k, s] : t0[k, s] + rt[k, s]] for k, s in runs]
        full[name] = _cat(pool, name, got, dtype)
    return _slice(full, rn.sum(1), rt.sum(1), None if pads is None else pads[me]), sum(out_splits)


def run_equal(d: Data, pool: Pool, budget: int) -> tuple[list, int]:
    """Groups dealt by count, then equal-count micro-batches (as many as the heaviest
    learner's tokens need, capped at its group count)."""
    world = dist.get_world_size()
    tokens, _ = _counts(d, world)
    shares = [list(range(li, len(tokens), world)) for li in range(world)]
    heaviest = max(int(tokens[s].sum()) for s in shares)
    m = max(1, min(min(len(s) for s in shares), -(-heaviest // budget)))
    plan = [[c.tolist() for c in np.array_split(np.asarray(s), m)] for s in shares]
    return _exchange(d, pool, plan, tokens)


def run_padded(d: Data, pool: Pool, budget: int) -> tuple[list, int]:
    """Ours' split by tokens, each micro-batch's sequences padded to its own longest sequence
    (a learner without variable-length attention): padded on the holders, moved and cut as
    ours is."""
    world = dist.get_world_size()
    tokens, longest = _counts(d, world)
    plan = balance.plan(tokens.tolist(), world, budget)
    return _exchange(d, pool, plan, tokens, longest)


def run_allgather(d: Data, pool: Pool, budget: int) -> tuple[list, int]:
    """All-gather everything, then repack this learner's share of the split into
    micro-batches: per token field one ``cat`` of the share's runs (adjacent groups of a rank
    merged), per sequence field one indexed gather."""
    world, me, per, size = dist.get_world_size(), dist.get_rank(), d.groups, d.size
    n = per * size
    sizes = torch.empty(world, dtype=torch.int64)
    ALL_GATHER(sizes, torch.tensor([d.nbytes()]))
    width = int(sizes.max())
    buf = pool.get("send", width)  # packed in place, the tail past this rank's bytes unused
    d.pack(out=buf[: d.nbytes()])
    everything = pool.get("recv", world * width)
    ALL_GATHER(everything, buf)
    rows = everything.view(world, width)
    seq, at = {}, 0
    for name, dtype in SEQ_FIELDS:  # [world, n] each
        seq[name] = rows[:, at : at + n * dtype.itemsize].view(dtype)
        at += n * dtype.itemsize
    lens = seq["_length"]
    group_tokens = lens.view(world, per, size).sum(2)
    starts = (torch.cumsum(group_tokens, 1) - group_tokens).reshape(-1).tolist()
    gt = group_tokens.reshape(-1).numpy()
    plan = balance.plan(gt.tolist(), world, budget)
    mbs = plan[me]
    order = [g for mb in mbs for g in mb]
    runs: list[list[int]] = []  # [rank, first token, tokens]
    for g in order:
        r, t = g // per, int(gt[g])
        if runs and runs[-1][0] == r and runs[-1][1] + runs[-1][2] == starts[g]:
            runs[-1][2] += t
        else:
            runs.append([r, starts[g], t])
    views = [unpack(rows[r], n, int(lens[r].sum())) for r in range(world)]
    full = {
        name: _cat(pool, name, [views[r][name][s : s + t] for r, s, t in runs], dtype)
        for name, dtype in FIELDS
    }
    o = torch.as_tensor(order, dtype=torch.int64)
    seq_idx = (o[:, None] * size + torch.arange(size)).reshape(-1)  # into [world * n]
    for name, dtype in SEQ_FIELDS:
        out = pool.get(name, seq_idx.numel() * dtype.itemsize, dtype)
        full[name] = torch.index_select(seq[name].reshape(-1), 0, seq_idx, out=out)
    seqs = np.array([len(mb) * size for mb in mbs])
    toks = np.array([int(gt[mb].sum()) for mb in mbs])
    return _slice(full, seqs, toks, None), world * width
