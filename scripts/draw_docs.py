"""Draw the pictures of docs/ (docs/img/*.png), two of them from a real measured run.

Two steps:

1. ``torchrun --standalone --nproc_per_node=2 scripts/draw_docs.py measure`` runs a tiny
   colocated job on 2 gloo ranks and writes ``docs/img/overlap_trace.json``: both ranks'
   Chrome traces (``DataPlane(trace=True)``, ``plane.export_trace``), aligned on one clock
   (open it in https://ui.perfetto.dev), and under ``otherData`` every iteration's
   ``plane.last_fetch`` (exposed / hidden ms) and wall time. The job: every rank puts 128
   items of 16 KB per iteration and fetches 256 (``round_robin`` placement, the library's
   default ``uniform`` sampler, general rounds), learns with a small MLP whose backward also waits
   ``--backward-ms`` with the host CPU idle (``time.sleep`` in an autograd function: a stand-in
   for a GPU backward, as ``bench latency``'s off-CPU learner), ``plane.attach(model)``; blocks
   of ``sync`` and ``overlap`` iterations alternate.
2. ``python scripts/draw_docs.py draw`` draws loop.png, round.png, tiers.png (diagrams; tiers
   with the GB/s ``conduit_dist.tools.info.measure_tiers`` measures now), overlap.png (a window of
   three iterations of that trace, sync above overlap) and exposed_vs_hidden.png (every measured
   iteration's exposed and hidden ms).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

IMG = Path(__file__).resolve().parents[1] / "docs" / "img"
TRACE = IMG / "overlap_trace.json"
MODES = ("sync", "overlap")
WARMUP = 3  # iterations of each plane left out of the statistics


# ---------------------------------------------------------------------------------- measure


def _job(a: argparse.Namespace) -> None:
    """Every rank: alternate sync / overlap planes, trace them, write the merged trace."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import conduit_dist as cd
    from conduit_dist.sched import timeline as tl_mod

    class DeviceTime(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            time.sleep(a.backward_ms / 1e3)  # host CPU idle, as while a GPU runs the backward
            return grad

    class Learner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 6))

        def forward(self, obs):
            return DeviceTime.apply(self.net(obs[:, :256].float() / 255.0))

    torch.set_num_threads(1)
    cd.init_distributed()
    rank = cd.get_rank()
    g = torch.Generator().manual_seed(rank)
    batch = {
        "obs": torch.randint(0, 256, (a.put, a.item_bytes), dtype=torch.uint8, generator=g),
        "action": torch.randint(0, 6, (a.put,), generator=g),
        "reward": torch.randn(a.put, generator=g),
    }
    spec = cd.ExperienceSpec.from_batch(batch)
    model = Learner()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    tmp = Path(tempfile.mkdtemp(prefix="draw-docs-")) if rank == 0 else None
    shared = [str(tmp)] if rank == 0 else [None]
    dist.broadcast_object_list(shared, src=0)
    runs, load = [], os.getloadavg()
    for block in range(a.blocks):
        for mode in MODES:
            plane = cd.DataPlane(
                spec, 8 * a.put, seed=block, schedule=mode, trace=True, placement="round_robin"
            )
            plane.attach(model)
            line = plane.timeline
            records = []
            for it in range(a.iters + WARMUP):
                t0 = time.perf_counter()
                plane.put(batch)  # the plane's timeline records "put" itself
                b = plane.fetch(a.batch)
                timing = plane.last_fetch
                loss = nn.functional.mse_loss(
                    model(b["obs"]).gather(1, b["action"].view(-1, 1)).squeeze(1), b["reward"]
                )
                t2 = time.perf_counter()
                loss.backward()
                t3 = time.perf_counter()
                opt.step()
                opt.zero_grad(set_to_none=True)
                t4 = time.perf_counter()
                line.add("backward", line.LEARNER, t2, t3)
                line.add("opt.step", line.LEARNER, t3, t4)
                keep = ("exposed_ms", "hidden_ms", "prefetched", "lag_rounds")
                records.append(
                    {"iteration": it, "warmup": it < WARMUP, "t0": t0 - tl_mod._T0,
                     "iteration_ms": (t4 - t0) * 1e3, **{k: getattr(timing, k) for k in keep}}
                )  # fmt: skip
            path = plane.export_trace(f"{shared[0]}/rank{rank}-{mode}-{block}.json")
            plane.close()
            runs.append({"rank": rank, "mode": mode, "block": block, "trace": path})
            runs[-1]["records"] = records  # t0: seconds on this rank's trace clock (_T0)
    meta = {"rank": rank, "t0": tl_mod._T0, "runs": runs, "load": load}
    gathered = [None] * cd.get_world_size()
    dist.all_gather_object(gathered, meta)
    if rank == 0:
        _merge(gathered, a)
        shutil.rmtree(tmp, ignore_errors=True)
    cd.destroy_distributed()


def _merge(ranks: list[dict], a: argparse.Namespace) -> None:
    """One Chrome trace of every rank and plane on a common clock, with the per-fetch records."""
    origin = min(m["t0"] for m in ranks)
    last = a.blocks - 1  # the trace keeps the last block's events (the records: every block)
    events, runs = [], []
    for m in ranks:
        shift = (m["t0"] - origin) * 1e6  # every rank's perf_counter is the same monotonic clock
        for run in m["runs"]:
            with open(run["trace"]) as f:
                for ev in json.load(f)["traceEvents"]:
                    if ev["ph"] == "X":
                        ev["ts"] = round(ev["ts"] + shift, 1)
                        ev["dur"] = round(ev["dur"], 1)
                        ev["args"] = {**ev["args"], "mode": run["mode"], "block": run["block"]}
                    if (ev["ph"] == "X" and run["block"] == last) or (
                        ev["ph"] == "M" and run is m["runs"][0]
                    ):
                        events.append(ev)
            for r in run["records"]:
                r["t0"] = round((r["t0"] + m["t0"] - origin) * 1e3, 3)  # ms on the trace clock
            runs.append({k: run[k] for k in ("rank", "mode", "block", "records")})
    how = "torchrun --standalone --nproc_per_node=2 scripts/draw_docs.py measure " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in sorted(vars(a).items()) if k != "cmd"
    )
    settings = {k: v for k, v in vars(a).items() if k != "cmd"}
    load = {"start": ranks[0]["load"], "end": os.getloadavg()}  # 1/5/15-minute load averages
    other = {"how": how, "settings": settings, "load_average": load, "runs": runs}
    TRACE.parent.mkdir(parents=True, exist_ok=True)
    with open(TRACE, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}, f)
    print(json.dumps(_summary(runs)))


def _summary(runs: list[dict]) -> dict:
    """Medians over both ranks' steady iterations, per mode."""
    out = {}
    for mode in MODES:
        recs = [r for run in runs if run["mode"] == mode for r in run["records"] if not r["warmup"]]
        out[mode] = {
            k: statistics.median(r[k] for r in recs)
            for k in ("exposed_ms", "hidden_ms", "iteration_ms")
        }
        out[mode]["iterations"] = len(recs)
    return out


# ---------------------------------------------------------------------------------- drawing

COLORS = {
    "put": "#9e9e9e",
    "fetch (waiting)": "#d62728",
    "forward": "#6baed6",
    "backward": "#2171b5",
    "opt.step": "#6a51a3",
    "ingest": "#fd8d3c",
    "sample": "#fdae6b",
    "deliver": "#e6550d",
    "weights": "#a63603",
}
LOCAL, COLLECTIVE, USER = "#eeeeee", "#fdd0a2", "#c6dbef"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 9, "savefig.dpi": 110})
    return plt


def _box(ax, x, y, w, h, text, color=LOCAL, size=8, weight="normal"):
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(
        FancyBboxPatch(
            (x, y), w, h, boxstyle="round,pad=0.004,rounding_size=0.008", fc=color, ec="#444444"
        )
    )
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, weight=weight)


def _arrow(ax, a, b, text="", color="#333333", style="-|>", rad=0.0, size=7.5):
    ax.annotate(
        "",
        xy=b,
        xytext=a,
        arrowprops={"arrowstyle": style, "color": color, "lw": 1.3, "shrinkA": 2, "shrinkB": 2,
                    "connectionstyle": f"arc3,rad={rad}"},
    )  # fmt: skip
    if text:
        mx, my = (a[0] + b[0]) / 2, (a[1] + b[1]) / 2
        ax.text(mx, my, text, fontsize=size, ha="center", va="center", color=color,
                bbox={"fc": "white", "ec": "none", "pad": 0.5})  # fmt: skip


def _canvas(plt, w, h, title):
    fig, ax = plt.subplots(figsize=(w, h))
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.axis("off")
    ax.set_title(title, fontsize=10, weight="bold")
    return fig, ax


def _lanes(ax, title, lanes, band):
    """One column per rank (its calls above its shard), the round as a band below them all."""
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.axis("off")
    ax.set_title(title, fontsize=10, weight="bold")
    w = 0.94 / len(lanes)
    for i, (name, code, down, up) in enumerate(lanes):
        x = 0.03 + i * w
        _box(ax, x, 0.62, w - 0.04, 0.3, f"{name}\n{code}", USER, size=7.5)
        _box(ax, x + w * 0.3, 0.4, w * 0.4 - 0.04, 0.1, f"shard {i}")
        _arrow(ax, (x + w * 0.12, 0.62), (x + w * 0.12, 0.27), down, size=7)
        _arrow(ax, (x + w * 0.78, 0.27), (x + w * 0.78, 0.62), up, size=7)
        _arrow(ax, (x + w * 0.48, 0.4), (x + w * 0.48, 0.27), style="<|-|>")
    _box(ax, 0.03, 0.05, 0.9, 0.22, band, COLLECTIVE, size=7.5)


def draw_loop(plt, path: Path) -> None:
    """Colocated (every rank acts and learns) beside disaggregated (actors and one learner)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4), width_ratios=(2, 3))
    learner = "batch = plane.fetch(b)\nloss.backward(); opt.step()"
    _lanes(left, "colocated: every rank acts and learns", [
        (f"rank {i}", f"envs + policy: plane.put(batch)\n{learner}\nplane.attach(model)",
         "put", "batch") for i in range(2)
    ], "one round per iteration, every rank (inside fetch, or\nbehind backward with attach): "
       "ingest staged items\ninto the shards, sample from all of them,\ndeliver each learner's "
       "batch")  # fmt: skip
    actor = "envs + policy: plane.put(batch)\nplane.flush()\nplane.pull_weights(model)"
    _lanes(right, "disaggregated: DataPlane(..., learner_ranks=[0])", [
        ("rank 0 (learner)", f"{learner}\nplane.publish_weights(model)", "weights", "batch"),
        ("rank 1 (actor)", actor, "put", "weights"),
        ("rank 2 (actor)", actor, "put", "weights"),
    ], "one round per iteration, every rank: the learner's fetch and each actor's flush own it;"
       "\ningest the actors' items into the shards (every rank hosts one), sample, deliver\n"
       "the learner's batch; a newly published version is broadcast in the round")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path)


GENERAL = [
    ("ingest", "1 prepare + meta exchange, one small all_to_all_single: the meta row\n"
     "   (rounds/meta.py); meanwhile pack donated puts, settle the demoter", COLLECTIVE),
    ("ingest", "2 placement.plan (or route: whole streams) -> send[src, dst]  (no message)", LOCAL),
    ("ingest", "3 ingest staged rows into their owner shards  (Transport.move:\n"
     "   all_to_all / p2p / chunked4 / gather, as the bandwidth model prices them)", COLLECTIVE),
    ("ingest", "4 header exchange, when the sampler reports shard values (priority\n"
     "   masses), routes feedback or a payload rides: headers | candidates | updates", COLLECTIVE),
    ("sample", "5 sampler.allocate -> counts[learner, shard]  (the same on every rank)", LOCAL),
    ("deliver", "6 candidates' prefixes + own share; or draw, gather and deliver the other\n"
     "   shards' rows to each learner  (Transport.move)", COLLECTIVE),
    ("weights", "7 take (queues); weights broadcast, if a newer version was published", COLLECTIVE),
    ("", "8 start background demotion; publish sizes (len(plane))", LOCAL),
]  # fmt: skip
FUSED = [
    ("ingest", "1 prepare; commit puts written into the storage's reserved rows, append\n"
     "   staged rows (stale items dropped and evicted: max_policy_age)", LOCAL),
    ("ingest", "2 header = the meta row: [staged, request, weights version + bytes,\n"
     "   stale, size, payload?, sampler values]", LOCAL),
    ("ingest", "3 speculative samplers: draw candidates for every peer learner: its last\n"
     "   request x this shard's last share + 6 sd + 1% + 4  (wire.candidates)", LOCAL),
    ("ingest", "4 ONE all_to_all_single, per peer:\n"
     "   [header | payload (reduce=) | candidate rows | priority updates]", COLLECTIVE),
    ("ingest", "5 every header -> shard sizes, requests; priority updates received", LOCAL),
    ("sample", "6 sampler.allocate (the same on every rank); take the first k of each\n"
     "   shard's candidates, draw the own share (short, or not speculative:\n"
     "   every rank runs the exact delivery exchange)", LOCAL),
    ("weights", "7 take (queues); weights broadcast, if a newer version was published", COLLECTIVE),
    ("", "8 start background demotion; publish sizes", LOCAL),
]  # fmt: skip


def _steps(ax, x, steps, title, sub):
    ax.text(x, 0.965, title, fontsize=9.5, weight="bold")
    ax.text(x, 0.93, sub, fontsize=7.5, style="italic")
    h, gap, y = 0.08, 0.022, 0.91
    spans: dict[str, list[float]] = {}
    for phase, text, color in steps:
        y -= h + gap
        _box(ax, x, y, 0.42, h, "", color)
        ax.text(x + 0.008, y + h / 2, text, fontsize=7, va="center")
        if phase:
            spans.setdefault(phase, []).extend([y, y + h])
    for phase, ys in spans.items():  # the trace phase (Timeline, last_fetch) the steps fall in
        lo, hi = min(ys), max(ys)
        ax.plot([x + 0.43] * 2, [lo + 0.004, hi - 0.004], color=COLORS[phase], lw=3)
        ax.text(x + 0.435, (lo + hi) / 2, phase, fontsize=7, va="center", color=COLORS[phase])


def draw_round(plt, path: Path) -> None:
    """A round's steps as RoundEngine runs them on its two multi-rank schedules, grouped by
    their trace phase."""
    fig, ax = _canvas(plt, 12, 5.6, "")
    _steps(
        ax,
        0.01,
        GENERAL,
        "the general schedule (rounds/engine.py: RoundEngine._general)",
        "round_robin / bandwidth_aware placement (any sampler), CUDA delivery",
    )
    _steps(
        ax,
        0.53,
        FUSED,
        "the fused schedule (rounds/engine.py: RoundEngine._launch/_finish)",
        "placement='local' (any sampler), CPU delivery",
    )
    for color, text, x in (
        (COLLECTIVE, "collective on the plane's own group", 0.55),
        (LOCAL, "local work, replicated inputs: no message", 0.77),
    ):
        _box(ax, x, 0.025, 0.015, 0.03, "", color)
        ax.text(x + 0.022, 0.04, text, fontsize=7.5, va="center")  # fmt: skip
    ax.text(0.01, 0.04, "Every rank runs every round, in the same order; a learner's fetch and an "
            "actor's flush each own one.\nColoured bars: the phase each step is timed in "
            "(RoundStats, plane.last_fetch, export_trace).", fontsize=7.5, va="center")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path)


def draw_tiers(plt, path: Path, gbps: dict[str, dict]) -> None:
    """Tiers fastest first: newest items in the first, demotion down, eviction from the last."""
    fig, ax = _canvas(plt, 11, 3.6, "cd.Tiers: one shard over several tiers (tiers/tiered.py)")
    names = {"device": "device\n(GPU memory)", "pinned": "pinned\n(page-locked host)",
             "host": "host\n(pageable memory)", "disk": "disk\n(memory-mapped file)"}  # fmt: skip
    xs = (0.13, 0.345, 0.56, 0.775)
    _box(ax, 0.01, 0.48, 0.085, 0.22, "round\ningests\nnew items", COLLECTIVE)
    _arrow(ax, (0.095, 0.59), (0.13, 0.59))
    for i, (kind, x) in enumerate(zip(names, xs)):
        t = gbps.get(kind)
        rate = (f"read {t['read_gbps']:.2f} / write {t['write_gbps']:.2f} GB/s"
                if t else "needs CUDA: not measured here")  # fmt: skip
        _box(ax, x, 0.45, 0.15, 0.28, names[kind], USER if t else LOCAL, size=8.5)
        ax.text(x + 0.075, 0.4, rate, ha="center", fontsize=7)
        if i < 3:
            _arrow(ax, (x + 0.15, 0.59), (xs[i + 1], 0.59), "demote\noldest")
    _arrow(ax, (0.925, 0.59), (0.985, 0.59), color="#d62728")
    ax.text(0.955, 0.68, "evict\noldest", ha="center", fontsize=7.5, color="#d62728")
    ax.annotate("", xy=(0.13, 0.8), xytext=(0.925, 0.8),
                arrowprops={"arrowstyle": "<-", "color": "#555555"})  # fmt: skip
    ax.text(0.535, 0.84, "newest items  ...  oldest items (FIFO across tiers)", ha="center",
            fontsize=8)  # fmt: skip
    ax.text(0.535, 0.22, "Between rounds a worker thread demotes ahead the room the next round "
            "needs (background=True); the next round waits for it (demotion_wait_ms).\nSampling "
            "draws logical indices 0..size-1 over every tier (uniform over all items) and "
            "gathers each row from the tier that holds it.\nTiers are listed fastest first, e.g. "
            "cd.Tiers([(\"host\", 250_000), (\"disk\", 750_000)], disk_dir=\"/scratch\"); "
            "plane.store_stats() shows items, bytes, GB/s per tier.", ha="center", va="center",
            fontsize=7.5)  # fmt: skip
    ax.text(
        0.535,
        0.03,
        "GB/s: Tier.calibrate on this machine (16 MiB of 1 KiB records; "
        "python -m conduit_dist info prints them)",
        ha="center",
        fontsize=7,
        style="italic",
    )
    fig.tight_layout()
    fig.savefig(path)


def _load_trace() -> dict:
    if not TRACE.is_file():
        sys.exit(f"{TRACE} is missing: run the measure step first (see this script's docstring)")
    with open(TRACE) as f:
        return json.load(f)


def draw_overlap(plt, path: Path, trace: dict, first: int = 6, count: int = 3) -> None:
    """``count`` iterations of each mode's last block from the real trace, both ranks."""
    other = trace["otherData"]
    last = max(r["block"] for r in other["runs"])
    fig, axes = plt.subplots(2, 1, figsize=(11, 4.8), sharex=True)
    tracks = {(0, 1): 3, (0, 2): 2, (1, 1): 1, (1, 2): 0}  # (rank, Timeline track) -> row
    labels = ["rank 1 plane", "rank 1 learner", "rank 0 plane", "rank 0 learner"]
    width = 0.0
    for ax, mode in zip(axes, MODES):
        recs = next(
            r["records"] for r in other["runs"]
            if r["rank"] == 0 and r["mode"] == mode and r["block"] == last
        )  # fmt: skip
        lo, hi = recs[WARMUP + first]["t0"], recs[WARMUP + first + count]["t0"]
        width = max(width, hi - lo)
        for ev in trace["traceEvents"]:
            args = ev.get("args", {})
            if ev["ph"] != "X" or args.get("mode") != mode or args.get("block") != last:
                continue
            a, d = ev["ts"] / 1e3, ev["dur"] / 1e3
            if a + d < lo or a > hi or ev["name"] not in COLORS:
                continue
            row = tracks[(ev["pid"], ev["tid"])]
            ax.broken_barh([(a - lo, d)], (row + 0.15, 0.7), color=COLORS[ev["name"]])
        steady = [r for r in recs if not r["warmup"]]
        exp = statistics.median(r["exposed_ms"] for r in steady)
        hid = statistics.median(r["hidden_ms"] for r in steady)
        it = statistics.median(r["iteration_ms"] for r in steady)
        ax.set_title(f"{mode} (rank 0, this block's medians): fetch exposed {exp:.2f} ms, hidden "
                     f"{hid:.2f} ms; iteration {it:.1f} ms", fontsize=9)  # fmt: skip
        ax.set_yticks([0.5, 1.5, 2.5, 3.5], labels)
    axes[-1].set_xlim(0, width)
    axes[-1].set_xlabel("ms (3 consecutive iterations, both ranks on one clock)")
    from matplotlib.patches import Patch

    fig.legend(handles=[Patch(color=c, label=n) for n, c in COLORS.items()], loc="lower center",
               ncol=9, fontsize=7.5, frameon=False)  # fmt: skip
    s = other["settings"]
    fig.suptitle(f"A real trace (export_trace), 2 gloo ranks on 2 CPU cores: {s['put']} items of "
                 f"{s['item_bytes'] // 1024} KB put and {s['batch']} fetched per rank and "
                 f"iteration, backward {s['backward_ms']:g} ms off the CPU",
                 fontsize=9)  # fmt: skip
    fig.tight_layout(rect=(0, 0.06, 1, 0.97))
    fig.savefig(path)


def draw_exposed(plt, path: Path, trace: dict) -> dict:
    """Every steady iteration's exposed / hidden experience-path ms, sync beside overlap."""
    other = trace["otherData"]
    summary = _summary(other["runs"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), sharey=True)
    for ax, mode in zip(axes, MODES):
        recs = [r for run in other["runs"] if run["mode"] == mode and run["rank"] == 0
                for r in run["records"] if not r["warmup"]]  # fmt: skip
        x = range(len(recs))
        exp = [r["exposed_ms"] for r in recs]
        ax.bar(x, exp, width=1.0, color="#d62728", label="exposed: the learner waits in fetch")
        ax.bar(x, [r["hidden_ms"] for r in recs], bottom=exp, width=1.0, color="#2ca02c",
               label="hidden: ran before fetch, behind the compute")  # fmt: skip
        m = summary[mode]
        ax.set_title(f"schedule='{mode}': exposed {m['exposed_ms']:.2f} ms, hidden "
                     f"{m['hidden_ms']:.2f} ms\niteration {m['iteration_ms']:.1f} ms (medians, "
                     f"both ranks)",
                     fontsize=9)  # fmt: skip
        ax.set_xlabel("iteration (rank 0)")
    axes[0].set_ylabel("experience path per fetch, ms")
    axes[1].legend(fontsize=7.5, loc="upper right")
    st = other["settings"]
    fig.suptitle(f"Measured: 2 gloo ranks on 2 CPU cores, per rank and iteration put {st['put']} x "
                 f"{st['item_bytes'] // 1024} KB, fetch {st['batch']}, backward "
                 f"{st['backward_ms']:g} ms off the CPU", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path)
    return summary


def main(argv: list[str]) -> None:
    """``measure`` (under torchrun, 2 ranks) or ``draw`` (plain python)."""
    p = argparse.ArgumentParser(prog="scripts/draw_docs.py", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="the traced 2-rank job (torchrun)")
    m.add_argument("--put", type=int, default=128, help="items each rank puts per iteration")
    m.add_argument("--batch", type=int, default=256, help="items each rank fetches")
    m.add_argument("--item-bytes", type=int, default=16384, help="bytes of an item's obs")
    m.add_argument("--backward-ms", type=float, default=10.0, help="off-CPU backward time")
    m.add_argument("--iters", type=int, default=20, help="measured iterations per plane")
    m.add_argument("--blocks", type=int, default=2, help="sync/overlap blocks, alternating")
    sub.add_parser("draw", help="draw docs/img/*.png (the trace must exist)")
    a = p.parse_args(argv)
    if a.cmd == "measure":
        _job(a)
        return
    from conduit_dist.tools.info import measure_tiers

    plt = _plt()
    IMG.mkdir(parents=True, exist_ok=True)
    draw_loop(plt, IMG / "loop.png")
    draw_round(plt, IMG / "round.png")
    gbps = measure_tiers(1024, None)
    print("tiers:", json.dumps(gbps))
    draw_tiers(plt, IMG / "tiers.png", gbps)
    trace = _load_trace()
    draw_overlap(plt, IMG / "overlap.png", trace)
    print("exposed vs hidden:", json.dumps(draw_exposed(plt, IMG / "exposed_vs_hidden.png", trace)))
    for name in ("loop", "round", "tiers", "overlap", "exposed_vs_hidden"):
        print(f"{IMG / name}.png: {os.path.getsize(IMG / f'{name}.png') // 1024} KB")


if __name__ == "__main__":
    main(sys.argv[1:])
