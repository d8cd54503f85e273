"""Soak test: put + fetch at full speed on a tiered store, watching for leaks over time.

torchrun --standalone --nproc_per_node=2 scripts/soak.py --minutes 30   # the recorded run
python scripts/soak.py --minutes 0.5 --every-s 5 --warmup-s 10           # one rank, a quick look

Every rank is a colocated learner (``schedule="sync"``: the round runs inside ``fetch``): each
iteration puts ``--put`` items and fetches ``--batch``, on a store of several tiers (``--tiers``,
host + disk by default, sized so items are demoted to disk continuously, in the background).
With ``--sampler prioritized`` each fetch's ``"_index"`` gets fresh random priorities.

Every ``--every-s`` seconds each rank samples its process: RSS (``VmRSS``, and its anonymous and
file-backed parts: the disk tier is a mapped file, whose resident pages count as ``RssFile``),
open file descriptors, Python and OS threads (torch and gloo start native threads), items and
bytes per tier, items put and fetched, rounds/s and rounds per CPU second (which tells a slower
loop from one that got less CPU). Every ``--check-every`` iterations rank 0 broadcasts whether to
go on, sample or stop (one 8-byte broadcast), so every rank samples at the same iteration and runs
the same rounds.

Progress goes to stderr (rank 0); the last line of stdout is a JSON summary (rank 0): every rank's
samples, the growth of RSS, threads and open files after the warm-up, the tiers' bytes, and a
``verdict``: ``rss_growth_ok`` (the median of the last 3 samples' RSS over the first 3's grew at
most ``--rss-tol-pct``), ``threads_ok`` and ``files_ok`` (no growth, first vs last sample after
the warm-up), their conjunction ``pass``, and, outside ``pass``, ``rss_anon_growth_ok`` (the same
for anonymous memory only). The exit status is 0 whatever the verdict.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist

import conduit_dist as cd
from conduit_dist.logging import log_rank_zero

BASE_FIELDS = (
    "t_s", "rss_kb", "rss_anon_kb", "rss_file_kb", "disk_map_rss_kb", "fds", "py_threads",
    "os_threads", "items_put", "items_fetched", "rounds", "rounds_per_s", "cpu_s",
    "rounds_per_cpu_s", "evictions", "demotions",
)  # fmt: skip
GO, SAMPLE, STOP = 0, 1, 2


# ------------------------------------------------------------------------------------- arguments


def parse_tiers(text: str) -> list[tuple[str, int]]:
    """``"host=20000,disk=180000"`` -> ``[("host", 20000), ("disk", 180000)]``."""
    tiers = []
    for part in text.split(","):
        kind, sep, n = part.partition("=")
        if not sep or not n.strip().isdigit() or int(n) < 1:
            raise argparse.ArgumentTypeError(f"expected kind=items[,kind=items...], got {text!r}")
        tiers.append((kind.strip(), int(n)))
    if len(tiers) < 2:
        raise argparse.ArgumentTypeError(f"a soak needs at least two tiers, got {text!r}")
    return tiers


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--minutes", type=float, default=30.0, help="run length (default 30)")
    p.add_argument("--every-s", type=float, default=10.0, help="seconds between samples")
    p.add_argument(
        "--warmup-s",
        type=float,
        default=None,
        help="samples before this are excluded (default: max(60 s, 10%% of the run), at most "
        "half the run)",
    )
    p.add_argument("--tiers", type=parse_tiers, default=parse_tiers("host=20000,disk=180000"))
    p.add_argument("--dir", default=tempfile.gettempdir(), help="parent of the disk tier's dir")
    p.add_argument("--sampler", choices=("uniform", "prioritized"), default="uniform")
    p.add_argument("--placement", choices=("local", "round_robin"), default="local")
    p.add_argument("--put", type=int, default=256, help="items put per rank per iteration")
    p.add_argument("--batch", type=int, default=256, help="items fetched per rank per iteration")
    p.add_argument("--obs-dim", type=int, default=64, help="float32 obs and next_obs width")
    p.add_argument("--check-every", type=int, default=32, help="iterations between decisions")
    p.add_argument("--rss-tol-pct", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.every_s <= 0:
        p.error(f"--minutes and --every-s must be > 0, got {args.minutes} and {args.every_s}")
    if args.sampler == "prioritized" and args.placement != "local":
        p.error("--sampler prioritized needs --placement local (exact PER over every shard)")
    run_s = args.minutes * 60
    if args.warmup_s is None:
        args.warmup_s = min(max(60.0, 0.1 * run_s), 0.5 * run_s)
    return args


# ------------------------------------------------------------------------------- process probes


def proc_status() -> dict[str, int]:
    """``VmRSS``, ``RssAnon``, ``RssFile`` (kB) and ``Threads`` from ``/proc/self/status``;
    psutil where there is no ``/proc`` (RSS and threads only), -1 where neither is available."""
    keys = {"VmRSS": "rss_kb", "RssAnon": "rss_anon_kb", "RssFile": "rss_file_kb"}
    out = {"rss_kb": -1, "rss_anon_kb": -1, "rss_file_kb": -1, "os_threads": -1}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in keys:
                    out[keys[name]] = int(value.split()[0])
                elif name == "Threads":
                    out["os_threads"] = int(value)
    except OSError:
        try:
            import psutil
        except ImportError:
            return out
        proc = psutil.Process()
        out["rss_kb"], out["os_threads"] = proc.memory_info().rss // 1024, proc.num_threads()
    return out


def mapped_rss_kb(marker: str = "conduit-tier-") -> int:
    """Resident kB of the mappings of files whose name holds ``marker`` (the disk tiers' files):
    the part of ``RssFile`` that is page cache of the store, not libraries (-1 without smaps)."""
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                    inside = marker in line
                elif inside and line.startswith("Rss:"):
                    total += int(line.split()[1])
    except OSError:
        return -1
    return total


def cpu_seconds() -> float:
    """User + system CPU seconds of this process, all threads (tells a slower loop from a
    loop that got less CPU: other processes on the machine)."""
    t = os.times()
    return t.user + t.system


def open_fds() -> int:
    """Open file descriptors of this process (-1 without ``/proc``)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


# -------------------------------------------------------------------------------------- the loop


def make_batch(n: int, obs_dim: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "id": torch.arange(n, dtype=torch.int64),
        "obs": torch.randn((n, obs_dim), generator=g),
        "next_obs": torch.randn((n, obs_dim), generator=g),
        "action": torch.randint(0, 6, (n,), generator=g),
        "reward": torch.randn(n, generator=g),
        "done": torch.rand(n, generator=g) < 0.01,
    }


class Soak:
    """One rank's loop: put, fetch (and update priorities), sample when rank 0 says so."""

    def __init__(self, args: argparse.Namespace, disk_dir: str) -> None:
        self.args, self.rank = args, cd.get_rank()
        self.batch = make_batch(args.put, args.obs_dim, args.seed + self.rank)
        sampler = cd.Prioritized() if args.sampler == "prioritized" else "uniform"
        self.plane = cd.DataPlane(
            cd.ExperienceSpec.from_batch(self.batch),
            sum(n for _, n in args.tiers),
            seed=args.seed,
            sampler=sampler,
            placement=args.placement,
            storage=cd.Tiers(args.tiers, disk_dir=disk_dir, background=True),
            schedule="sync",
        )
        self.gen = torch.Generator().manual_seed(args.seed + 1000 + self.rank)
        names = [f"{i}_{kind}" for i, (kind, _) in enumerate(args.tiers)]
        self.fields = [*BASE_FIELDS, *(f"{n}_{k}" for n in names for k in ("items", "bytes"))]
        self.rows: list[list[float]] = []
        self.put_n = self.fetched_n = 0
        self.t0 = self._last_t = time.perf_counter()
        self._last_round, self._last_cpu = 0, cpu_seconds()

    def step(self) -> None:
        self.batch["id"].add_(self.args.put)  # distinct items, no allocation
        self.plane.put(self.batch)
        self.put_n += self.args.put
        out = self.plane.fetch(self.args.batch)
        self.fetched_n += out["id"].shape[0]
        if "_index" in out:
            prio = torch.rand(out["_index"].shape[0], generator=self.gen) + 0.01
            self.plane.update_priorities(out["_index"], prio)

    def sample(self) -> list[float]:
        now, stats, proc = time.perf_counter(), self.plane.store_stats(), proc_status()
        rounds, cpu = self.plane.round, cpu_seconds()
        rate = (rounds - self._last_round) / max(now - self._last_t, 1e-9)
        cpu_rate = (rounds - self._last_round) / max(cpu - self._last_cpu, 1e-9)
        self._last_t, self._last_round, self._last_cpu = now, rounds, cpu
        row = [
            now - self.t0, proc["rss_kb"], proc["rss_anon_kb"], proc["rss_file_kb"],
            mapped_rss_kb(), open_fds(),
            threading.active_count(), proc["os_threads"], self.put_n, self.fetched_n, rounds,
            rate, cpu, cpu_rate, stats["evictions"], stats["demotions"],
        ]  # fmt: skip
        for tier in stats["tiers"]:
            row += [tier["items"], tier["bytes"]]
        self.rows.append([float(x) for x in row])
        return self.rows[-1]

    def decide(self) -> int:
        """Rank 0's clock says whether to go on, sample or stop; every rank gets its word."""
        flag = torch.zeros(1, dtype=torch.int64)
        if self.rank == 0:
            t = time.perf_counter() - self.t0
            due = self.rows[-1][0] + self.args.every_s
            flag[0] = STOP if t >= self.args.minutes * 60 else SAMPLE if t >= due else GO
        if cd.get_world_size() > 1:
            dist.broadcast(flag, src=0)
        return int(flag[0])

    def run(self) -> None:
        self.sample()
        it = 0
        while True:
            self.step()
            it += 1
            if it % self.args.check_every:
                continue
            flag = self.decide()
            if flag == GO:
                continue
            row = self.sample()
            if self.rank == 0:
                log_progress(self.fields, row)
            if flag == STOP:
                return


def log_progress(fields: list[str], row: list[float]) -> None:
    r = dict(zip(fields, row))
    tiers = " ".join(
        f"{k[:-6]}={r[k] / 2**20:.1f}MiB" for k in fields if k.endswith("_bytes") and k[0].isdigit()
    )
    log_rank_zero(
        "t=%6.1fs rss=%.1fMiB (anon %.1f, file %.1f, disk map %.1f) fds=%d threads=%d/%d "
        "put=%d fetched=%d rounds/s=%.0f (%.0f per CPU s) %s",
        r["t_s"], r["rss_kb"] / 1024, r["rss_anon_kb"] / 1024, r["rss_file_kb"] / 1024,
        r["disk_map_rss_kb"] / 1024, r["fds"],
        r["py_threads"], r["os_threads"], r["items_put"], r["items_fetched"], r["rounds_per_s"],
        r["rounds_per_cpu_s"], tiers,
    )  # fmt: skip


# ------------------------------------------------------------------------------------ the summary


def gather_rows(rows: list[list[float]], width: int) -> list[list[list[float]]]:
    """Every rank's rows on every rank (fixed-size float64 all_gathers, no pickling)."""
    mine = torch.tensor(rows, dtype=torch.float64).reshape(-1, width)
    world = cd.get_world_size()
    if world == 1:
        return [mine.tolist()]
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([mine.shape[0]]))
    n = max(int(c) for c in counts)
    padded = torch.full((n, width), float("nan"), dtype=torch.float64)
    padded[: mine.shape[0]] = mine
    every = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(every, padded)
    return [t[: int(c)].tolist() for t, c in zip(every, counts)]


def growth_pct(first: float, last: float) -> float | None:
    return None if first <= 0 else round(100.0 * (last - first) / first, 3)


def median3_growth(values: list[float], post: list[int]) -> float | None:
    """Growth of the median of the last 3 post-warm-up samples over that of the first 3."""
    head, tail = [values[i] for i in post[:3]], [values[i] for i in post[-3:]]
    return growth_pct(statistics.median(head), statistics.median(tail))


def post_warmup_growth(col: dict[str, list], post: list[int]) -> dict[str, object]:
    """RSS growth (last vs first, and median of the last 3 vs the first 3), thread and open-file
    deltas over the post-warm-up samples ``post`` (at least two)."""
    a, b = post[0], post[-1]
    r0 = max(a, 1)  # sample 0 has no interval before it, hence no rate
    rss, anon = col["rss_kb"], col["rss_anon_kb"]
    delta = {k: col[k][b] - col[k][a] for k in ("os_threads", "py_threads", "fds")}
    return {
        "rss_growth_pct": growth_pct(rss[a], rss[b]),
        "rss_growth_pct_median3": median3_growth(rss, post),
        "rss_anon_growth_pct": growth_pct(anon[a], anon[b]),
        "rss_anon_growth_pct_median3": median3_growth(anon, post),
        "rss_file_growth_pct": growth_pct(col["rss_file_kb"][a], col["rss_file_kb"][b]),
        "disk_map_rss_kb_first_last": [col["disk_map_rss_kb"][a], col["disk_map_rss_kb"][b]],
        "rss_kb_first_last": [rss[a], rss[b]],
        "rss_kb_max": max(rss[i] for i in post),
        **{f"{k}_delta": d for k, d in delta.items()},
        "os_threads_max": max(col["os_threads"][i] for i in post),
        "fds_max": max(col["fds"][i] for i in post),
        "rounds_per_s_first_last": [col["rounds_per_s"][r0], col["rounds_per_s"][b]],
        "rounds_per_cpu_s_first_last": [col["rounds_per_cpu_s"][r0], col["rounds_per_cpu_s"][b]],
    }


def rank_report(fields: list[str], rows: list[list[float]], args, after_close) -> dict:
    """One rank's summary: growth after warm-up, tier bytes, totals, and what close released."""
    col = {f: [_num(r[i]) for r in rows] for i, f in enumerate(fields)}
    post = [i for i, t in enumerate(col["t_s"]) if t >= args.warmup_s]
    tiers = [f for f in fields if f[0].isdigit() and f.endswith("_bytes")]

    def tier_bytes(i: int) -> dict[str, int]:
        return {f.removesuffix("_bytes"): col[f][i] for f in tiers}

    wall, rounds = col["t_s"][-1], col["rounds"][-1]
    return {
        "post_warmup_samples": len(post),
        "post_warmup": post_warmup_growth(col, post) if len(post) >= 2 else None,
        "tier_bytes": {
            "first_sample": tier_bytes(0),
            "after_warmup": tier_bytes(post[0]) if post else None,
            "end": tier_bytes(-1),
        },
        "wall_s": wall,
        **{
            k: col[k][-1]
            for k in ("items_put", "items_fetched", "rounds", "evictions", "demotions")
        },
        "rounds_per_s": round(rounds / wall, 1) if wall > 0 else None,
        "after_close": dict(zip(("rss_kb", "fds", "py_threads", "os_threads"), after_close)),
    }


def verdict(reports: list[dict], tol_pct: float) -> dict[str, object]:
    def ok(key, test):
        vals = [(r["post_warmup"] or {}).get(key) for r in reports]
        return all(v is not None and test(v) for v in vals)

    robust = "rss_growth_pct_median3"
    v: dict[str, object] = {
        "rss_growth_ok": ok(robust, lambda g: g <= tol_pct),
        "rss_metric": f"{robust} <= {tol_pct}",
        # not in "pass": anonymous memory alone (a leak), without the mapped disk tier and
        # libraries, whose resident pages come and go with the page cache
        "rss_anon_growth_ok": ok("rss_anon_growth_pct_median3", lambda g: g <= tol_pct),
        "threads_ok": ok("os_threads_delta", lambda d: d <= 0)
        and ok("py_threads_delta", lambda d: d <= 0),
        "files_ok": ok("fds_delta", lambda d: d <= 0),
        "enough_samples": all(r["post_warmup_samples"] >= 2 for r in reports),
    }
    v["pass"] = all(v[k] for k in ("rss_growth_ok", "threads_ok", "files_ok", "enough_samples"))
    return v


def summarize(fields, every_rows, args, every_close) -> dict:
    reports = [
        {"rank": r, **rank_report(fields, rows, args, list(map(_num, close)))}
        for r, (rows, close) in enumerate(zip(every_rows, every_close))
    ]
    return {
        "bench": "soak",
        "world": len(every_rows),
        "config": vars(args),
        "verdict": verdict(reports, args.rss_tol_pct),
        "ranks": reports,
        "samples": {
            "fields": fields,
            "by_rank": [[list(map(_num, r)) for r in rows] for rows in every_rows],
        },
    }


def _num(x: float) -> float | int:
    """Counts as ints, the rest rounded (a compact JSON)."""
    return int(x) if float(x).is_integer() else round(x, 3)


# ------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="soak: %(message)s")
    cd.init_distributed(timeout_s=300.0)
    rank = cd.get_rank()
    disk_dir = tempfile.mkdtemp(prefix=f"conduit-soak-r{rank}-", dir=args.dir)
    soak = None
    try:
        soak = Soak(args, disk_dir)
        log_rank_zero(
            "%d rank(s), tiers %s, %s sampler, %s placement, %.1f min, warm-up %.0f s",
            cd.get_world_size(), args.tiers, args.sampler, args.placement, args.minutes,
            args.warmup_s,
        )  # fmt: skip
        soak.run()
        soak.plane.close()
        proc = proc_status()
        close = [proc["rss_kb"], open_fds(), threading.active_count(), proc["os_threads"]]
        every_rows = gather_rows(soak.rows, len(soak.fields))
        every_close = gather_rows([close], 4)
        if rank == 0:
            summary = summarize(soak.fields, every_rows, args, [c[0] for c in every_close])
            log_rank_zero("verdict: %s", summary["verdict"])
            print(json.dumps(summary), flush=True)
    finally:
        if soak is not None:
            soak.plane.close()  # a no-op after a clean close
        shutil.rmtree(disk_dir, ignore_errors=True)
        cd.destroy_distributed()


if __name__ == "__main__":
    main()
