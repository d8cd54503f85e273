"""``torchrun --standalone --nproc_per_node=4 -m conduit_dist.bench tokens``: delivering a global
batch of LLM-RL prompt groups to data-parallel learners, against three schemes in use.

Workload: every rank generates ``--groups-per-rank`` groups of ``--group-size`` responses whose
lengths are lognormal (median ``--median`` tokens, sigma 1), 1% of them 6,144-8,192 tokens,
clipped to [16, 8192]; per token an int32 id, a float32 log-prob and a bool loss mask, per
sequence a float32 reward. The global batch is every rank's groups; every rank learns.

Side by side, interleaved sample by sample on the same data and the same process group (each
sample after a barrier; the slowest rank's wall; medians):

- ``ours``: ``cd.TokenPlane.fetch(groups, token_budget)``: the group table in one all-gather,
  a Karmarkar-Karp split by tokens, one exchange without padding, packed micro-batches out;
- ``equal_counts``: the same exchange (raw ``all_to_all_single`` of packed bytes, after an
  all-gather of the groups' token counts) with groups dealt by count, ``j -> j % world``;
- ``padded``: ours' assignment, every sequence padded to the global batch's longest;
- ``allgather``: every rank ``all_gather_into_tensor`` s every rank's packed groups (padded to the
  largest rank's bytes, sizes gathered first) and repacks its own share of the same
  Karmarkar-Karp split into micro-batches: the redistribution another framework uses.

Also the raw collectives alone: an ``all_gather_into_tensor`` and an ``all_to_all_single`` of
the mean per-rank bytes. Summary: ``balance_max_over_mean`` (max learner tokens over the mean,
measured on what each learner received), ``wire_over_token_bytes`` (bytes received over the
sequence data they carry), ``speedup_vs_allgather`` (allgather ms over ours), and each
baseline's own figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

import conduit_dist as cd
from conduit_dist.bench.common import emit, number
from conduit_dist.tokens import balance

FIELDS = (("tokens", torch.int32), ("logprobs", torch.float32), ("loss_mask", torch.bool))
MAX_LEN = 8192
# torch 2.13 names it all_gather_single (all_gather_into_tensor is its deprecated alias)
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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
        self.size = size
        self.starts = torch.cumsum(self.lengths, 0) - self.lengths
        self.group_tokens = self.lengths.view(groups, size).sum(1)

    def batch(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return {**self.fields, "reward": self.reward, "group": self.group}, self.lengths

    def seqs(self, groups: list[int]) -> torch.Tensor:
        """Sequence indices of local ``groups`` (in order)."""
        g = torch.as_tensor(groups, dtype=torch.int64)
        return (g[:, None] * self.size + torch.arange(self.size)).reshape(-1)

    def pack(self, groups: list[int], pad_to: int = 0) -> torch.Tensor:
        """``groups`` as one byte buffer: lengths, rewards, then each field (packed, or padded
        per sequence to ``pad_to``)."""
        s = self.seqs(groups)
        lengths = self.lengths[s]
        parts = [lengths.view(torch.uint8), self.reward[s].view(torch.uint8)]
        if pad_to:
            pos = torch.arange(pad_to)
            idx = self.starts[s][:, None] + pos
            mask = pos[None, :] < lengths[:, None]
            for _, f in ((n, self.fields[n]) for n, _ in FIELDS):
                full = torch.zeros((len(s), pad_to), dtype=f.dtype)
                full[mask] = f[idx[mask]]
                parts.append(full.reshape(-1).view(torch.uint8))
        else:
            tok = torch.repeat_interleave(
                self.starts[s] - (torch.cumsum(lengths, 0) - lengths), lengths
            ) + torch.arange(int(lengths.sum()))
            parts += [self.fields[n][tok].view(torch.uint8) for n, _ in FIELDS]
        if not len(s):
            return torch.zeros(0, dtype=torch.uint8)
        size = sum(p.numel() for p in parts)
        parts.append(torch.zeros(-size % 8, dtype=torch.uint8))  # the next section 8-aligned
        return torch.cat(parts)


def unpack(buf: torch.Tensor, n: int, pad_to: int = 0) -> dict[str, torch.Tensor]:
    """Inverse of :meth:`Data.pack` for ``n`` sequences."""
    lengths = buf[: 8 * n].view(torch.int64)
    out, at = {"_length": lengths, "reward": buf[8 * n : 12 * n].view(torch.float32)}, 12 * n
    total = n * pad_to if pad_to else int(lengths.sum())
    for name, dtype in FIELDS:
        nb = total * dtype.itemsize
        out[name] = buf[at : at + nb].view(dtype)
        at += nb
    return out


def _kk_owner(tokens: np.ndarray, world: int, budget: int) -> tuple[np.ndarray, list]:
    plan = balance.plan(tokens.tolist(), world, budget)
    owner = np.empty(len(tokens), dtype=np.int64)
    for li, mbs in enumerate(plan):
        owner[[i for mb in mbs for i in mb]] = li
    return owner, plan


def _gather_counts(d: Data, world: int) -> np.ndarray:
    """Every rank's group token counts (rank-major), one small all-gather."""
    out = torch.empty(world * d.group_tokens.numel(), dtype=torch.int64)
    ALL_GATHER(out, d.group_tokens)
    return out.numpy()


def _exchange(d: Data, owner: np.ndarray, world: int, pad_to: int = 0) -> tuple[list, int]:
    """Raw all-to-all of the groups each learner owns; returns the received parts and bytes."""
    me, per = dist.get_rank(), d.group_tokens.numel()
    mine = owner[me * per : (me + 1) * per]
    sends = [d.pack(np.flatnonzero(mine == r).tolist(), pad_to) for r in range(world)]
    in_splits = [int(s.numel()) for s in sends]
    sizes = torch.tensor(in_splits, dtype=torch.int64)
    all_sizes = torch.empty(world * world, dtype=torch.int64)
    ALL_GATHER(all_sizes, sizes)
    out_splits = all_sizes.view(world, world)[:, me].tolist()
    recv = torch.empty(sum(out_splits), dtype=torch.uint8)
    dist.all_to_all_single(recv, torch.cat(sends), out_splits, in_splits)
    counts = [int((owner[r * per : (r + 1) * per] == me).sum()) * d.size for r in range(world)]
    parts = list(torch.split(recv, out_splits))
    return [unpack(p, n, pad_to) for p, n in zip(parts, counts, strict=True) if n], sum(out_splits)


def _cat(parts: list[dict]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]} if parts else {}


def run_equal(d: Data, world: int) -> tuple[int, int]:
    tokens = _gather_counts(d, world)
    owner = np.arange(len(tokens)) % world
    parts, nbytes = _exchange(d, owner, world)
    got = _cat(parts)
    return int(got["_length"].sum()) if got else 0, nbytes


def run_padded(d: Data, world: int, budget: int) -> tuple[int, int]:
    tokens = _gather_counts(d, world)
    longest = torch.tensor([int(d.lengths.max())])
    dist.all_reduce(longest, op=dist.ReduceOp.MAX)
    owner, _ = _kk_owner(tokens, world, budget)
    parts, nbytes = _exchange(d, owner, world, int(longest))
    got = _cat(parts)
    return int(got["_length"].sum()) if got else 0, nbytes


def run_allgather(d: Data, world: int, budget: int) -> tuple[int, int]:
    """All-gather everything, then repack this learner's KK share into micro-batches."""
    me, per = dist.get_rank(), d.group_tokens.numel()
    mine = d.pack(list(range(per)))
    sizes = torch.empty(world, dtype=torch.int64)
    ALL_GATHER(sizes, torch.tensor([mine.numel()]))
    width = int(sizes.max())
    buf = torch.zeros(width, dtype=torch.uint8)
    buf[: mine.numel()] = mine
    everything = torch.empty(world * width, dtype=torch.uint8)
    ALL_GATHER(everything, buf)
    ranks = [unpack(everything[r * width : (r + 1) * width], per * d.size) for r in range(world)]
    tokens = np.concatenate([r["_length"].view(per, d.size).sum(1).numpy() for r in ranks])
    _, plan = _kk_owner(tokens, world, budget)
    got = 0
    for mb in plan[me]:  # each micro-batch: the groups' sequences gathered into packed tensors
        pieces = {name: [] for name, _ in FIELDS}
        for g in mb:
            r, lg = divmod(g, per)
            lens = ranks[r]["_length"]
            start = int(lens[: lg * d.size].sum())
            stop = start + int(lens[lg * d.size : (lg + 1) * d.size].sum())
            for name, _ in FIELDS:
                pieces[name].append(ranks[r][name][start:stop])
        packed = {k: torch.cat(v) for k, v in pieces.items()}
        got += int(packed["tokens"].numel())
    return got, world * width


def _sample(fn) -> float:
    dist.barrier()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv: list[str]) -> None:
    """Run the tokens benchmark (every rank) and print the JSON line last on rank 0."""
    p = argparse.ArgumentParser(prog="python -m conduit_dist.bench tokens")
    p.add_argument("--groups-per-rank", type=number(int, 1), default=256)
    p.add_argument("--group-size", type=number(int, 1), default=8)
    p.add_argument("--median", type=number(float, 16), default=256.0, help="median length")
    p.add_argument("--token-budget", type=number(int, MAX_LEN), default=16_384)
    p.add_argument("--samples", type=number(int, 3), default=7)
    p.add_argument("--warmup", type=number(int, 0), default=2)
    a = p.parse_args(argv)
    cd.init_distributed()
    torch.set_num_threads(1)
    me, world = dist.get_rank(), dist.get_world_size()
    spec = cd.TokenSpec(
        {n: cd.Ragged(t, MAX_LEN) for n, t in FIELDS} | {"reward": ((), torch.float32)},
        group_size=a.group_size,
    )
    per = a.groups_per_rank
    tp = cd.TokenPlane(spec, 4 * per * a.group_size, 4 * per * a.group_size * 2 * MAX_LEN // 8)
    rng = np.random.default_rng(1000 + me)
    rows: dict[str, list] = {k: [] for k in ("ours", "equal", "padded", "allgather", "ag", "a2a")}
    got: dict[str, list] = {k: [] for k in ("ours", "equal", "padded", "allgather")}
    wire: dict[str, list] = {k: [] for k in ("ours", "ours_data", "padded")}
    for i in range(a.warmup + a.samples):
        d = Data(rng, per, a.group_size, a.median, base=(i * world + me) * per)
        tp.put(*d.batch())
        out: dict = {}

        def ours(d=d, out=out) -> None:
            out["mbs"] = tp.fetch(per * world, a.token_budget)

        t = {"ours": _sample(ours)}
        toks = {"ours": sum(mb.tokens for mb in out["mbs"])}
        wire_i = (tp.last.wire_bytes, tp.last.token_bytes)
        for name, fn in (
            ("equal", lambda d=d: run_equal(d, world)),
            ("padded", lambda d=d: run_padded(d, world, a.token_budget)),
            ("allgather", lambda d=d: run_allgather(d, world, a.token_budget)),
        ):
            res: list = []
            t[name] = _sample(lambda fn=fn, res=res: res.append(fn()))
            toks[name] = res[0][0]
            if name == "padded":
                pad_bytes = res[0][1]
        mean = torch.tensor([d.pack(list(range(per))).numel()], dtype=torch.int64)
        dist.all_reduce(mean)  # the same size on every rank: the mean rank's bytes
        raw_bytes = int(mean) // world
        src = torch.zeros(raw_bytes - raw_bytes % world, dtype=torch.uint8)
        dst_ag = torch.empty(world * src.numel(), dtype=torch.uint8)
        dst_a2a = torch.empty_like(src)
        t["ag"] = _sample(lambda o=dst_ag, s=src: ALL_GATHER(o, s))
        t["a2a"] = _sample(lambda o=dst_a2a, s=src: dist.all_to_all_single(o, s))
        if i < a.warmup:
            continue
        for k in rows:
            rows[k].append(t[k])
        for k in got:
            got[k].append(toks[k])
        wire["ours"].append(wire_i[0])
        wire["ours_data"].append(wire_i[1])
        wire["padded"].append(pad_bytes)
    tp.close()
    # the slowest rank's wall per sample; per-learner tokens and bytes from every rank
    walls = torch.tensor([rows[k] for k in rows], dtype=torch.float64)
    dist.all_reduce(walls, op=dist.ReduceOp.MAX)
    toks = torch.tensor([got[k] for k in got], dtype=torch.float64)
    all_toks = [torch.empty_like(toks) for _ in range(world)]
    dist.all_gather(all_toks, toks)
    wb = torch.tensor([wire[k] for k in wire], dtype=torch.float64)
    dist.all_reduce(wb)
    if me == 0:
        _report(a, world, rows, walls, got, all_toks, wb)
    cd.destroy_distributed()


def _report(a, world, rows, walls, got, all_toks, wb) -> None:
    ms = {k: statistics.median(walls[i].tolist()) * 1e3 for i, k in enumerate(rows)}
    stacked = torch.stack(all_toks)  # [rank, scheme, sample]
    bal = {}
    for j, k in enumerate(got):
        per_sample = stacked[:, j, :]
        bal[k] = statistics.median((per_sample.max(0).values / per_sample.mean(0)).tolist())
    ours_ratio = float(wb[0].sum() / wb[1].sum())
    padded_ratio = float(wb[2].sum() / wb[1].sum())
    summary = {
        "balance_max_over_mean": bal["ours"],
        "wire_over_token_bytes": ours_ratio,
        "speedup_vs_allgather": ms["allgather"] / ms["ours"],
        "ours_ms": ms["ours"],
        "equal_counts_ms": ms["equal"],
        "equal_counts_balance_max_over_mean": bal["equal"],
        "padded_ms": ms["padded"],
        "padded_wire_over_token_bytes": padded_ratio,
        "padded_balance_max_over_mean": bal["padded"],
        "allgather_ms": ms["allgather"],
        "allgather_balance_max_over_mean": bal["allgather"],
        "raw_all_gather_ms": ms["ag"],
        "raw_all_to_all_ms": ms["a2a"],
        "raw_all_gather_over_all_to_all": ms["ag"] / ms["a2a"],
    }
    for k, v in summary.items():
        print(f"{k:>36}: {v:.3f}", flush=True)
    emit(
        "tokens",
        [],
        summary,
        world=world,
        groups_per_rank=a.groups_per_rank,
        group_size=a.group_size,
        token_budget=a.token_budget,
        samples=a.samples,
    )
