"""``torchrun --standalone --nproc_per_node=4 -m conduit_dist.bench tokens``: delivering a global
batch of LLM-RL prompt groups to data-parallel learners, against three schemes in use.

Workload: every rank generates ``--groups-per-rank`` groups of ``--group-size`` responses whose
lengths are lognormal (median ``--median`` tokens, sigma 1), 1% of them 6,144-8,192 tokens,
clipped to [16, 8192]; per token an int32 id, a float32 log-prob and a bool loss mask, per
sequence a float32 reward and the int64 group id. The global batch is every rank's groups;
every rank learns. Each sample: every rank puts fresh groups (untimed), then each scheme
delivers that global batch after a barrier; the schemes' order rotates from sample to sample.
A sample's time is the slowest rank's wall (a delivery ends when its last learner has its
micro-batches); figures are medians over samples.

Every scheme's timing ends with the learner holding its micro-batches: per field one packed
tensor per micro-batch (padded rows for ``padded``), the lengths and ``cu_seqlens``:

- ``ours``: ``cd.TokenPlane.fetch(groups, token_budget)``: the group table in one all-gather,
  a Karmarkar-Karp (largest-first beyond 256 groups) split by tokens, one exchange without
  padding whose sizes every rank derives from the table, micro-batches cut on arrival;
- ``equal_counts``: groups dealt by count, global group ``j -> j % world``, micro-batches of
  equal group counts; moved as ours is (token counts all-gathered, every rank derives the byte
  matrix, one raw ``all_to_all_single`` of packed bytes, holders pack in micro-batch order, the
  learner cuts each field with one ``cat`` of runs): only the assignment differs;
- ``padded``: ours' split, every sequence padded to the global batch's longest (its length
  all-reduced), moved and cut the same way;
- ``allgather``: every rank ``all_gather_into_tensor`` s every rank's packed groups (padded to
  the largest rank's bytes, the sizes all-gathered first), computes the same split from the
  gathered lengths and repacks its share with one ``cat`` of runs per field (4x faster here
  than one ``index_select`` of vectorised indices): the redistribution another framework uses.

Also the raw collectives alone: an ``all_gather_into_tensor`` and an ``all_to_all_single`` of
the mean rank's packed bytes per rank (``--profile``: cProfile of ours' fetches on rank 0).

Summary: ``balance_max_over_mean`` (the most tokens a learner received over the mean, per
sample, median), ``wire_over_token_bytes`` (bytes every learner received over the sequence data
they carry: 9 bytes a token, 20 a sequence for its length, reward and group id, counted by the
bench from the micro-batches), ``speedup_vs_allgather`` (allgather ms over ours), each
baseline's own figures beside them and the raw collectives.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

import conduit_dist as cd
from conduit_dist.bench import token_overlap
from conduit_dist.bench.common import emit, number
from conduit_dist.bench.token_baselines import (
    ALL_GATHER,
    FIELDS,
    MAX_LEN,
    SEQ_BYTES,
    TOKEN_BYTES,
    Data,
    align8,
    run_allgather,
    run_equal,
    run_padded,
)

SCHEMES = ("ours", "equal", "padded", "allgather", "ag", "a2a")


def _sample(fn) -> float:
    dist.barrier()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv: list[str]) -> None:
    """Run the tokens benchmark (every rank) and print the JSON line last on rank 0."""
    if any(x.split("=")[0] in ("--cost", "--learner-cost") for x in argv):  # balance in time
        from conduit_dist.bench import token_balance

        return token_balance.main(argv)
    p = argparse.ArgumentParser(prog="python -m conduit_dist.bench tokens")
    p.add_argument(
        "--groups-per-rank", type=number(int, 1), default=256,
        help="groups each rank generates a global batch (256: about 8 MB of token data)",
    )  # fmt: skip
    p.add_argument("--group-size", type=number(int, 1), default=8)
    p.add_argument("--median", type=number(float, 16), default=256.0, help="median length")
    p.add_argument("--token-budget", type=number(int, MAX_LEN), default=16_384)
    p.add_argument("--samples", type=number(int, 3), default=7)
    p.add_argument("--warmup", type=number(int, 0), default=2)
    p.add_argument("--profile", action="store_true", help="cProfile ours' fetches on rank 0")
    p.add_argument(
        "--backward-ms", type=number(float, 0), default=0.0,
        help="> 0: the overlap mode (bench/token_overlap.py): each micro-batch's backward "
        "takes this long off the CPU, the next batch's round launched at its start vs run in fetch",
    )  # fmt: skip
    p.add_argument("--steps", type=number(int, 3), default=12, help="overlap mode: timed steps")
    a = p.parse_args(argv)
    if a.backward_ms > 0:
        cd.init_distributed()
        torch.set_num_threads(1)
        try:
            token_overlap.run(a)
        finally:
            cd.destroy_distributed()
        return
    cd.init_distributed()
    torch.set_num_threads(1)
    me, world = dist.get_rank(), dist.get_world_size()
    spec = cd.TokenSpec(
        {n: cd.Ragged(t, MAX_LEN) for n, t in FIELDS} | {"reward": ((), torch.float32)},
        group_size=a.group_size,
    )
    per, size = a.groups_per_rank, a.group_size
    tp = cd.TokenPlane(spec, 4 * per * size, 4 * per * size * 2 * MAX_LEN // 8)
    prof = cProfile.Profile() if a.profile and me == 0 else None
    rng = np.random.default_rng(1000 + me)
    walls: dict[str, list] = {k: [] for k in SCHEMES}
    got: dict[str, list] = {k: [] for k in ("ours", "equal", "padded", "allgather")}
    wire: dict[str, list] = {k: [] for k in ("ours", "padded", "allgather", "data")}
    for i in range(a.warmup + a.samples):
        d = Data(rng, per, size, a.median, base=(i * world + me) * per)
        tp.put(*d.batch())
        mean = torch.tensor([d.nbytes()], dtype=torch.int64)
        dist.all_reduce(mean)  # the raw collectives move the mean rank's bytes
        src = torch.zeros(align8(int(mean) // world // world) * world, dtype=torch.uint8)
        dst_ag = torch.empty(world * src.numel(), dtype=torch.uint8)
        dst_a2a = torch.empty_like(src)
        out: dict = {}

        def ours(out=out) -> None:
            if prof is not None:
                prof.enable()
            out["ours"] = tp.fetch(per * world, a.token_budget)
            if prof is not None:
                prof.disable()

        fns = {
            "ours": ours,
            "equal": lambda d=d, out=out: out.__setitem__("equal", run_equal(d, a.token_budget)),
            "padded": lambda d=d, out=out: out.__setitem__("padded", run_padded(d, a.token_budget)),
            "allgather": lambda d=d, out=out: out.__setitem__(
                "allgather", run_allgather(d, a.token_budget)
            ),
            "ag": lambda o=dst_ag, s=src: ALL_GATHER(o, s),
            "a2a": lambda o=dst_a2a, s=src: dist.all_to_all_single(o, s),
        }
        k = i % len(SCHEMES)
        t = {name: _sample(fns[name]) for name in SCHEMES[k:] + SCHEMES[:k]}
        if i < a.warmup:
            continue
        for name in SCHEMES:
            walls[name].append(t[name])
        ours_mbs = out["ours"]
        tok = sum(mb.tokens for mb in ours_mbs)
        got["ours"].append(tok)
        for name in ("equal", "padded", "allgather"):
            got[name].append(sum(int(mb["_length"].sum()) for mb in out[name][0]))
        wire["ours"].append(tp.last.wire_bytes)
        wire["padded"].append(out["padded"][1])
        wire["allgather"].append(out["allgather"][1])
        wire["data"].append(tok * TOKEN_BYTES + sum(mb.sequences for mb in ours_mbs) * SEQ_BYTES)
    tp.close()
    # the slowest rank's wall per sample; per-learner tokens from every rank; bytes summed
    w = torch.tensor([walls[k] for k in SCHEMES], dtype=torch.float64)
    dist.all_reduce(w, op=dist.ReduceOp.MAX)
    toks = torch.tensor([got[k] for k in got], dtype=torch.float64)
    all_toks = [torch.empty_like(toks) for _ in range(world)]
    dist.all_gather(all_toks, toks)
    wb = torch.tensor([wire[k] for k in wire], dtype=torch.float64)
    dist.all_reduce(wb)
    if me == 0:
        if prof is not None:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(30)
            print(s.getvalue(), flush=True)
        _report(a, world, w, list(got), torch.stack(all_toks), wb)
    cd.destroy_distributed()


def _report(a, world: int, walls, got: list[str], stacked, wb) -> None:
    ms = {k: statistics.median(walls[i].tolist()) * 1e3 for i, k in enumerate(SCHEMES)}
    bal = {}
    for j, k in enumerate(got):  # stacked: [rank, scheme, sample]
        per_sample = stacked[:, j, :]
        bal[k] = statistics.median((per_sample.max(0).values / per_sample.mean(0)).tolist())
    data = float(wb[3].sum())
    summary = {
        "balance_max_over_mean": bal["ours"],
        "wire_over_token_bytes": float(wb[0].sum()) / data,
        "speedup_vs_allgather": ms["allgather"] / ms["ours"],
        "ours_ms": ms["ours"],
        "equal_counts_balance_max_over_mean": bal["equal"],
        "equal_counts_ms": ms["equal"],
        "padded_wire_over_token_bytes": float(wb[1].sum()) / data,
        "padded_ms": ms["padded"],
        "padded_balance_max_over_mean": bal["padded"],
        "allgather_ms": ms["allgather"],
        "allgather_balance_max_over_mean": bal["allgather"],
        "allgather_wire_over_token_bytes": float(wb[2].sum()) / data,
        "ours_vs_equal_counts": ms["ours"] / ms["equal"],
        "raw_all_gather_ms": ms["ag"],
        "raw_all_to_all_ms": ms["a2a"],
        "raw_all_gather_over_all_to_all": ms["ag"] / ms["a2a"],
        "token_data_mb_per_rank": data / world / a.samples / 1e6,
    }
    for k, v in summary.items():
        print(f"{k:>36}: {v:.4g}", flush=True)
    emit(
        "tokens",
        [{"scheme": k, "ms": ms[k]} for k in SCHEMES],
        summary,
        world=world,
        groups_per_rank=a.groups_per_rank,
        group_size=a.group_size,
        median=a.median,
        token_budget=a.token_budget,
        samples=a.samples,
    )
