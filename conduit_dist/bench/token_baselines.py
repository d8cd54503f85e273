"""``bench tokens``' workload and its three baselines (equal group counts, padding to the
longest, all-gather-then-repack), each handing the learner packed micro-batches with
``cu_seqlens`` as the token plane does (``bench/tokens.py`` measures them side by side)."""

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

    def pack(self, groups: list[int] | None = None, pad_to: int = 0) -> torch.Tensor:
        """``groups`` (local indices, in that order; ``None``: all, in order) as one byte
        buffer: lengths, group ids, rewards, then each token field (packed, or padded per
        sequence to ``pad_to``), zeros to an 8-byte multiple (:func:`section_bytes`)."""
        if groups is None and not pad_to:
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
            if pad_to:
                mask = torch.arange(pad_to)[None, :] < lengths[:, None]
                for f in self.fields.values():
                    full = torch.zeros((len(s), pad_to), dtype=f.dtype)
                    full[mask] = f[tok]
                    parts.append(full.reshape(-1))
            else:
                parts += [f[tok] for f in self.fields.values()]
        raw = [p.view(torch.uint8) for p in parts]
        size = sum(p.numel() for p in raw)
        return torch.cat([*raw, torch.zeros(-size % 8, dtype=torch.uint8)])


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


def _slice(full: dict, seqs: np.ndarray, toks: np.ndarray, pad_to: int = 0) -> list[dict]:
    """Micro-batches from each field's tensor in micro-batch order: ``seqs[k]`` sequences and
    ``toks[k]`` tokens each (``pad_to``: token fields are ``[sequences, pad_to]`` rows)."""
    seq_end, tok_end = np.cumsum(seqs), np.cumsum(toks)
    out = []
    for k in range(len(seqs)):
        s0, s1 = int(seq_end[k] - seqs[k]), int(seq_end[k])
        t0, t1 = (s0, s1) if pad_to else (int(tok_end[k] - toks[k]), int(tok_end[k]))
        mb = {n: full[n][s0:s1] for n, _ in SEQ_FIELDS}
        mb |= {n: full[n][t0:t1] for n, _ in FIELDS}
        cu = torch.zeros(s1 - s0 + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(mb["_length"], 0)
        mb["cu_seqlens"] = cu
        out.append(mb)
    return out


def _counts(d: Data, world: int) -> np.ndarray:
    """Every rank's group token counts (rank-major: global group ``r * per + j``)."""
    out = torch.empty(world * d.groups, dtype=torch.int64)
    ALL_GATHER(out, d.group_tokens)
    return out.numpy()


def _exchange(d: Data, plan: list, tokens: np.ndarray, pad_to: int = 0) -> tuple[list, int]:
    """Move the groups of ``plan[learner][micro] = [global group, ...]`` from their holders
    to their learners in one raw all-to-all (holders pack in micro-batch order; every rank
    derives the byte matrix from the gathered ``tokens``), then cut this learner's
    micro-batches with one ``cat`` of runs per field. Returns them and the bytes received."""
    world, me, per, size = dist.get_world_size(), dist.get_rank(), d.groups, d.size
    g_all = np.concatenate([[g for mb in p for g in mb] for p in plan])
    dest = np.repeat(np.arange(world), [sum(len(mb) for mb in p) for p in plan])
    holder = g_all // per
    n = np.zeros((world, world), np.int64)  # sequences holder -> learner
    t = np.zeros((world, world), np.int64)  # token positions holder -> learner
    np.add.at(n, (holder, dest), size)
    np.add.at(t, (holder, dest), size * pad_to if pad_to else tokens[g_all])
    nbytes = np.vectorize(section_bytes)(n, t)
    sends = []
    for li in range(world):
        mine = [g - me * per for mb in plan[li] for g in mb if g // per == me]
        sends.append(d.pack(mine, pad_to) if mine else torch.zeros(0, dtype=torch.uint8))
    in_splits, out_splits = nbytes[me].tolist(), nbytes[:, me].tolist()
    recv = torch.empty(sum(out_splits), dtype=torch.uint8)
    dist.all_to_all_single(recv, torch.cat(sends), out_splits, in_splits)
    parts = torch.split(recv, out_splits)
    cols = [unpack(parts[s], int(n[s, me]), int(t[s, me])) for s in range(world)]
    if pad_to:
        for c in cols:
            for name, _ in FIELDS:
                c[name] = c[name].view(-1, pad_to)
    mbs = plan[me]
    rn = np.zeros((len(mbs), world), np.int64)  # sequences of micro-batch k from holder s
    rt = np.zeros((len(mbs), world), np.int64)
    for k, mb in enumerate(mbs):
        g = np.asarray(mb)
        np.add.at(rn[k], g // per, size)
        np.add.at(rt[k], g // per, tokens[g])
    n0, t0 = np.cumsum(rn, 0) - rn, np.cumsum(rt, 0) - rt
    if pad_to:
        t0, rt_cut = n0, rn
    else:
        rt_cut = rt
    runs = [(k, s) for k in range(len(mbs)) for s in range(world) if rn[k, s]]
    full = {}
    for name, _ in SEQ_FIELDS:
        full[name] = torch.cat([cols[s][name][n0[k, s] : n0[k, s] + rn[k, s]] for k, s in runs])
    for name, _ in FIELDS:
        full[name] = torch.cat([cols[s][name][t0[k, s] : t0[k, s] + rt_cut[k, s]] for k, s in runs])
    return _slice(full, rn.sum(1), rt.sum(1), pad_to), sum(out_splits)


def run_equal(d: Data, budget: int) -> tuple[list, int]:
    """Groups dealt by count, then equal-count micro-batches (as many as the heaviest
    learner's tokens need, capped at its group count)."""
    world = dist.get_world_size()
    tokens = _counts(d, world)
    shares = [list(range(li, len(tokens), world)) for li in range(world)]
    heaviest = max(int(tokens[s].sum()) for s in shares)
    m = max(1, min(min(len(s) for s in shares), -(-heaviest // budget)))
    plan = [[c.tolist() for c in np.array_split(np.asarray(s), m)] for s in shares]
    return _exchange(d, plan, tokens)


def run_padded(d: Data, budget: int) -> tuple[list, int]:
    world = dist.get_world_size()
    tokens = _counts(d, world)
    longest = torch.tensor([int(d.lengths.max())])
    dist.all_reduce(longest, op=dist.ReduceOp.MAX)
    plan = balance.plan(tokens.tolist(), world, budget)
    return _exchange(d, plan, tokens, int(longest))


def run_allgather(d: Data, budget: int) -> tuple[list, int]:
    """All-gather everything, then repack this learner's share of the split into
    micro-batches: per token field one ``cat`` of the share's runs (adjacent groups of a rank
    merged), per sequence field one indexed gather."""
    world, me, per, size = dist.get_world_size(), dist.get_rank(), d.groups, d.size
    n = per * size
    mine = d.pack()
    sizes = torch.empty(world, dtype=torch.int64)
    ALL_GATHER(sizes, torch.tensor([mine.numel()]))
    width = int(sizes.max())
    if width == mine.numel():
        buf = mine
    else:
        buf = torch.zeros(width, dtype=torch.uint8)
        buf[: mine.numel()] = mine
    everything = torch.empty(world * width, dtype=torch.uint8)
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
    full = {name: torch.cat([views[r][name][s : s + t] for r, s, t in runs]) for name, _ in FIELDS}
    o = torch.as_tensor(order, dtype=torch.int64)
    seq_idx = (o[:, None] * size + torch.arange(size)).reshape(-1)  # into [world * n]
    full |= {name: v.reshape(-1)[seq_idx] for name, v in seq.items()}
    seqs = np.array([len(mb) * size for mb in mbs])
    toks = np.array([int(gt[mb].sum()) for mb in mbs])
    return _slice(full, seqs, toks), world * width
