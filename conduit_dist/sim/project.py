"""Projections of declared workloads from 8 to 4,096 GPUs, and where overlap stops hiding a round.

For each workload and machine, every power of two of ranks: the simulated round (its time, what
a round launched at the backward leaves exposed, bytes per link class, the strategies the model
picks). At the first size where the round outgrows the backward (overlap stops hiding it), the
same round is simulated with every other placement, to say what the model finds would move it.
"""

from __future__ import annotations

import time
from dataclasses import replace

from conduit_dist.sim.rounds import Workload, simulate
from conduit_dist.sim.topology import SimTopology

# DQN-like: small items, a high replay ratio, gradients in the round (colocated, local)
DQN = Workload(
    "dqn", record_bytes=64, puts_per_rank=8, batch_per_learner=256, reduce_numel=17_282,
    backward_ms=0.5, notes="CartPole-sized MLP; 32 samples per item put",
)  # fmt: skip
# Atari-like: 56 KB frames, one learner per node fed by 7 actors (disaggregated, round-robin)
ATARI = Workload(
    "atari", record_bytes=56_472, puts_per_rank=32, batch_per_learner=256, learner_every=8,
    producers="actors", placement="round_robin", backward_ms=5.0,
    notes="Nature-CNN learner on 8 GPUs' worth of actors per node",
)  # fmt: skip
# PPO-like: each rank's rollout stays on its shard, minibatches drawn over all of them
PPO = Workload(
    "ppo", record_bytes=320, puts_per_rank=2048, batch_per_learner=512, backward_ms=3.0,
    notes="2,048-step rollouts of 64-float observations per rank, minibatches of 512",
)  # fmt: skip
WORKLOADS = (DQN, ATARI, PPO)
WORLDS = tuple(2**k for k in range(3, 13))  # 8 .. 4,096
PLACEMENT_LIMIT = 1024  # bandwidth_aware's planner is quadratic: tried up to this many ranks


def project(topo: SimTopology, workloads=WORKLOADS, worlds=WORLDS) -> tuple[list[dict], list[dict]]:
    """Simulate every workload at every size on ``topo``.

    Returns:
        ``(rows, crossovers)``: a row per workload and size (``round_ms``, ``exposed_ms``,
        ``backward_ms``, ``bytes`` per link class, ``strategies``), and per workload the first
        size where the round exceeds the backward with every placement's round there
        (``alternatives``, ms) and the best of them; ``world: None`` if it never does.
    """
    rows, crossovers = [], []
    for w in workloads:
        cross = None
        for world in worlds:
            t0 = time.perf_counter()
            r = simulate(topo, world, w)
            rows.append({
                "workload": w.name, "topology": topo.name, "world": world,
                "round_ms": r.seconds * 1e3, "exposed_ms": r.exposed_s * 1e3,
                "backward_ms": w.backward_ms, "schedule": r.schedule,
                "bytes": r.bytes_by_link(),
                "strategies": {e.op: e.strategy for e in r.exchanges},
                "sim_s": time.perf_counter() - t0,
            })  # fmt: skip
            if cross is None and r.seconds > r.backward_s:
                cross = {"workload": w.name, "world": world, "round_ms": r.seconds * 1e3,
                         "placement": w.placement, "alternatives": {}}  # fmt: skip
                for placement in ("local", "round_robin", "bandwidth_aware"):
                    if placement == w.placement or (
                        placement == "bandwidth_aware" and world > PLACEMENT_LIMIT
                    ):
                        continue
                    alt = simulate(topo, world, replace(w, placement=placement))
                    cross["alternatives"][placement] = alt.seconds * 1e3
                alts = cross["alternatives"]
                best = min(alts, key=alts.get, default=None)
                # a placement that makes it faster, else what dominates the round
                cross["faster_placement"] = best if best and alts[best] < r.seconds * 1e3 else None
                cross["dominant"] = list(r.dominant())
        crossovers.append(cross or {"workload": w.name, "world": None})
    return rows, crossovers


def plot(rows: list[dict], path: str) -> None:
    """Round time and backward per workload against ranks (log-log), one panel per machine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    topos = sorted({r["topology"] for r in rows})
    fig, axes = plt.subplots(1, len(topos), figsize=(6 * len(topos), 4.2), squeeze=False)
    for ax, topo in zip(axes[0], topos):
        for i, name in enumerate(dict.fromkeys(r["workload"] for r in rows)):
            pts = [r for r in rows if r["topology"] == topo and r["workload"] == name]
            xs = [r["world"] for r in pts]
            color = f"C{i}"
            ax.plot(xs, [r["round_ms"] for r in pts], "o-", color=color, label=f"{name} round")
            ax.plot(xs, [r["backward_ms"] for r in pts], "--", color=color, alpha=0.6,
                    label=f"{name} backward")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("GPUs (ranks)")
        ax.set_ylabel("simulated round (ms)")
        ax.set_title(f"{topo}: a round hides while it is under the backward")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
