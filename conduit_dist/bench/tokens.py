"""``torchrun --standalone --nproc_per_node=4 -m conduit_dist.bench tokens``: delivering a global
batch of LLM-RL prompt groups to data-parallel learners, against equal group counts, padding
per micro-batch and (a reference) all-gather-then-repack.

Workload: every rank generates ``--groups-per-rank`` groups of ``--group-size`` responses whose
lengths are lognormal (median ``--median`` tokens, sigma 1), 1% of them 6,144-8,192 tokens,
clipped to [16, 8192]; per token an int32 id, a float32 log-prob and a bool loss mask, per
sequence a float32 reward and the int64 group id. The global batch is every rank's groups;
every rank learns. Each sample: every rank puts fresh groups (untimed), then each scheme
delivers that global batch after a barrier; the schemes' order rotates from sample to sample.
A sample's time is the slowest rank's wall (a delivery ends when its last learner has its
micro-batches); figures are medians over samples.

Every scheme's timing ends with the learner holding its micro-batches: per field one packed
tensor per micro-batch (padded rows for ``padded``), the lengths and ``cu_seqlens``. Every
baseline reuses its buffers from sample to sample (``token_baselines.Pool``), as the plane
reuses its own; the JSON counts buffers grown inside timed samples.

- ``ours``: ``cd.TokenPlane.fetch(groups, token_budget)`` as users run it (host sections through
  shared memory between the ranks of one host, ``ours_transport``): the group table in one
  all-gather, a Karmarkar-Karp (largest-first beyond 256 groups) split by tokens, one exchange
  without padding whose sizes every rank derives from the table, micro-batches cut on arrival;
- ``ours_gloo``: the same plane over gloo's ``all_to_all_single`` (``shared_memory=False``),
  the baselines' transport: the fair comparison;
- ``equal_counts``: groups dealt by count, global group ``j -> j % world``, micro-batches of
  equal group counts; moved as ours is (token counts all-gathered, every rank derives the byte
  matrix, one raw ``all_to_all_single`` of packed bytes, holders pack in micro-batch order, the
  learner cuts each field with one ``cat`` of runs): only the assignment differs;
- ``padded``: ours' split, each micro-batch's sequences padded to that micro-batch's longest
  (a learner without variable-length attention), padded on the holders, moved and cut the same
  way;
- ``allgather`` (a labelled reference, not a headline: gloo's all-gather costs far more than an
  all-to-all of the same bytes here): every rank all-gathers every rank's packed groups
  (padded to the largest rank's bytes, the sizes all-gathered first), computes the same split
  from the gathered lengths and repacks its share with one ``cat`` of runs per field.

Also the raw collectives alone: an ``all_gather_into_tensor`` and an ``all_to_all_single`` of
the mean rank's packed bytes per rank (``--profile``: cProfile of ours' fetches on rank 0).

``--groups-per-rank`` takes a comma list: every size is measured in one run, each with its own
summary (``summary.sweep``; the top-level keys are the first size's). Summary, the fair figure
first: ``ours_vs_equal_counts`` (ours over gloo / equal counts), ``balance_max_over_mean`` (the
most tokens a learner received over the mean, per sample, median), ``wire_over_token_bytes``
(bytes every learner received over the sequence data they carry: 9 bytes a token, 20 a
sequence for its length, reward and group id, counted from the micro-batches),
``ours_vs_raw_all_to_all`` (ours over gloo / the raw all-to-all), each baseline's own figures
and the reference's (``reference_allgather_*``).
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
    Pool,
    align8,
    run_allgather,
    run_equal,
    run_padded,
)

BASELINES = ("equal", "padded", "allgather")
SCHEMES = ("ours", "ours_gloo", *BASELINES, "ag", "a2a")


def _sample(fn) -> float:
    dist.barrier()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv: list[str]) -> None:
    """Run the tokens benchmark (every rank) and print the JSON line last on rank 0."""
    if any(x.split("=")[0] == "--peer" for x in argv):  # beside another data plane
        from conduit_dist.bench import tokens_peer

        return tokens_peer.main(argv)
    if any(x.split("=")[0] in ("--cost", "--learner-cost") for x in argv):  # balance in time
        from conduit_dist.bench import token_balance

        return token_balance.main(argv)
    p = argparse.ArgumentParser(prog="python -m conduit_dist.bench tokens")
    p.add_argument(
        "--groups-per-rank", type=sizes, default=None,
        help="groups each rank generates a global batch; a comma list is a sweep, each size "
        "measured in this run (default 32,256; 256 in the overlap mode; 256: about 8 MB of "
        "token data a rank)",
    )  # fmt: skip
    p.add_argument("--group-size", type=number(int, 1), default=8)
    p.add_argument("--median", type=number(float, 16), default=256.0, help="median length")
    p.add_argument("--token-budget", type=number(int, MAX_LEN), default=16_384)
    p.add_argument("--samples", type=number(int, 3), default=7)
    p.add_argument("--warmup", type=number(int, 1), default=2)
    p.add_argument("--profile", action="store_true", help="cProfile ours' fetches on rank 0")
    p.add_argument(
        "--backward-ms", type=number(float, 0), default=0.0,
        help="> 0: the overlap mode (bench/token_overlap.py): each micro-batch's backward "
        "takes this long off the CPU, the next batch's round launched at its start vs run in fetch",
    )  # fmt: skip
    p.add_argument("--steps", type=number(int, 3), default=12, help="overlap mode: timed steps")
    a = p.parse_args(argv)
    if a.groups_per_rank is None:
        a.groups_per_rank = [256] if a.backward_ms > 0 else [32, 256]
    if a.backward_ms > 0:
        if len(a.groups_per_rank) > 1:
            p.error(f"--groups-per-rank: the overlap mode takes one size, got {a.groups_per_rank}")
        a.groups_per_rank = a.groups_per_rank[0]
        cd.init_distributed()
        torch.set_num_threads(1)
        try:
            token_overlap.run(a)
        finally:
            cd.destroy_distributed()
        return
    cd.init_distributed()
    torch.set_num_threads(1)
    sweep = [_one_size(a, per) for per in a.groups_per_rank]
    if dist.get_rank() == 0:
        results = [r for row in sweep for r in row["results"]]
        summary = {**sweep[0]["summary"], "sweep": [row["summary"] for row in sweep]}
        emit(
            "tokens", results, summary, world=dist.get_world_size(),
            groups_per_rank=a.groups_per_rank, group_size=a.group_size, median=a.median,
            token_budget=a.token_budget, samples=a.samples, warmup=a.warmup,
        )  # fmt: skip
    cd.destroy_distributed()


def sizes(text: str) -> list[int]:
    """``--groups-per-rank``: one positive integer or a comma list of them."""
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(
            f"expected an integer >= 1 or a comma list of them, got {text!r}"
        )
    return out


def _one_size(a, per: int) -> dict:
    """Every scheme at ``per`` groups per rank; rank 0 gets the summary and result rows."""
    me, world = dist.get_rank(), dist.get_world_size()
    spec = cd.TokenSpec(
        {n: cd.Ragged(t, MAX_LEN) for n, t in FIELDS} | {"reward": ((), torch.float32)},
        group_size=a.group_size,
    )
    size = a.group_size
    caps = (4 * per * size, 4 * per * size * 2 * MAX_LEN // 8)
    tp = cd.TokenPlane(spec, *caps)  # as users run it: shared memory on one host (auto)
    # and over gloo's all_to_all_single, the baselines' and the raw exchange's transport
    gloo = cd.TokenPlane(spec, *caps, transport=cd.TransportConfig(shared_memory=False))
    transport = "shared memory" if tp.ex.shm is not None else "gloo"
    prof = cProfile.Profile() if a.profile and me == 0 else None
    rng = np.random.default_rng(1000 + me)
    pools = {k: Pool() for k in BASELINES}  # each baseline owns its buffers, as ours does
    walls: dict[str, list] = {k: [] for k in SCHEMES}
    got: dict[str, list] = {k: [] for k in ("ours", "ours_gloo", *BASELINES)}
    wire: dict[str, list] = {k: [] for k in ("ours", "padded", "allgather", "data")}
    src = dst_ag = dst_a2a = torch.empty(0, dtype=torch.uint8)
    for i in range(a.warmup + a.samples):
        d = Data(rng, per, size, a.median, base=(i * world + me) * per)
        tp.put(*d.batch())
        gloo.put(*d.batch())
        mean = torch.tensor([d.nbytes()], dtype=torch.int64)
        dist.all_reduce(mean)  # the raw collectives move the mean rank's bytes
        n_src = align8(int(mean) // world // world) * world
        if src.numel() < n_src:  # grown with headroom outside the timer, then reused
            src = torch.zeros(int(n_src * 1.5) // world * world, dtype=torch.uint8)
            dst_ag = torch.zeros(world * src.numel(), dtype=torch.uint8)
            dst_a2a = torch.zeros_like(src)
        out: dict = {}

        def ours(out=out) -> None:
            if prof is not None:
                prof.enable()
            out["ours"] = tp.fetch(per * world, a.token_budget)
            if prof is not None:
                prof.disable()

        fns = {
            "ours": ours,
            "ours_gloo": lambda out=out: out.__setitem__(
                "ours_gloo", gloo.fetch(per * world, a.token_budget)
            ),
            **{k: _baseline(k, d, pools[k], a.token_budget, out) for k in BASELINES},
            "ag": lambda o=dst_ag[: world * n_src], s=src[:n_src]: ALL_GATHER(o, s),
            "a2a": lambda o=dst_a2a[:n_src], s=src[:n_src]: dist.all_to_all_single(o, s),
        }
        if i == a.warmup:  # growths from here on happened inside a timed sample: reported
            for pool in pools.values():
                pool.reset_count()
        k = i % len(SCHEMES)
        t = {name: _sample(fns[name]) for name in SCHEMES[k:] + SCHEMES[:k]}
        if i < a.warmup:
            continue
        for name in SCHEMES:
            walls[name].append(t[name])
        ours_mbs = out["ours"]
        tok = sum(mb.tokens for mb in ours_mbs)
        got["ours"].append(tok)
        got["ours_gloo"].append(sum(mb.tokens for mb in out["ours_gloo"]))
        for name in BASELINES:
            got[name].append(sum(int(mb["_length"].sum()) for mb in out[name][0]))
        wire["ours"].append(tp.last.wire_bytes)
        wire["padded"].append(out["padded"][1])
        wire["allgather"].append(out["allgather"][1])
        wire["data"].append(tok * TOKEN_BYTES + sum(mb.sequences for mb in ours_mbs) * SEQ_BYTES)
    tp.close()
    gloo.close()
    # the slowest rank's wall per sample; per-learner tokens from every rank; bytes summed
    w = torch.tensor([walls[k] for k in SCHEMES], dtype=torch.float64)
    dist.all_reduce(w, op=dist.ReduceOp.MAX)
    toks = torch.tensor([got[k] for k in got], dtype=torch.float64)
    all_toks = [torch.empty_like(toks) for _ in range(world)]
    dist.all_gather(all_toks, toks)
    wb = torch.tensor([wire[k] for k in wire], dtype=torch.float64)
    dist.all_reduce(wb)
    grown = torch.tensor([pools[k].grown for k in BASELINES], dtype=torch.int64)
    dist.all_reduce(grown)
    if me != 0:
        return {}
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(30)
        print(s.getvalue(), flush=True)
    stacked = torch.stack(all_toks)
    return _report(a, per, world, w, list(got), stacked, wb, int(grown.sum()), transport)


def _baseline(name: str, d: Data, pool: Pool, budget: int, out: dict):
    run = {"equal": run_equal, "padded": run_padded, "allgather": run_allgather}[name]
    return lambda: out.__setitem__(name, run(d, pool, budget))


def _report(
    a, per: int, world: int, walls, got: list[str], stacked, wb, grown: int, transport: str
) -> dict:
    ms = {k: statistics.median(walls[i].tolist()) * 1e3 for i, k in enumerate(SCHEMES)}
    bal = {}
    for j, k in enumerate(got):  # stacked: [rank, scheme, sample]
        per_sample = stacked[:, j, :]
        bal[k] = statistics.median((per_sample.max(0).values / per_sample.mean(0)).tolist())
    data = float(wb[3].sum())
    summary = {  # the fair comparison first: the same transport (gloo's all_to_all_single)
        "groups_per_rank": per,
        "ours_vs_equal_counts": ms["ours_gloo"] / ms["equal"],
        "ours_gloo_ms": ms["ours_gloo"],
        "equal_counts_ms": ms["equal"],
        "ours_ms": ms["ours"],  # as users run it (ours_transport)
        "ours_transport": transport,
        "ours_default_vs_equal_counts": ms["ours"] / ms["equal"],
        "balance_max_over_mean": bal["ours"],
        "equal_counts_balance_max_over_mean": bal["equal"],
        "wire_over_token_bytes": float(wb[0].sum()) / data,
        "ours_vs_raw_all_to_all": ms["ours_gloo"] / ms["a2a"],  # both over gloo
        "padded_ms": ms["padded"],
        "padded_wire_over_token_bytes": float(wb[1].sum()) / data,
        "padded_balance_max_over_mean": bal["padded"],
        "raw_all_to_all_ms": ms["a2a"],
        "raw_all_gather_ms": ms["ag"],
        "raw_all_gather_over_all_to_all": ms["ag"] / ms["a2a"],
        # a labelled reference, not a headline: gloo's all-gather here costs far more than an
        # all-to-all of the same bytes, which flatters ours
        "reference_allgather_ms": ms["allgather"],
        "reference_allgather_over_ours": ms["allgather"] / ms["ours_gloo"],  # both gloo
        "reference_allgather_balance_max_over_mean": bal["allgather"],
        "reference_allgather_wire_over_token_bytes": float(wb[2].sum()) / data,
        "token_data_mb_per_rank": data / world / a.samples / 1e6,
        "baseline_buffers_grown_in_timed_samples": grown,
    }
    print(f"--- {per} groups per rank", flush=True)
    for k, v in summary.items():
        print(f"{k:>44}: {v if isinstance(v, str) else format(v, '.4g')}", flush=True)
    results = [{"groups_per_rank": per, "scheme": k, "ms": ms[k]} for k in SCHEMES]
    return {"summary": summary, "results": results}
