"""Projections of declared workloads from 8 to 4,096 GPUs, and where overlap stops hiding a round.

For each workload and machine, every power of two of ranks: the simulated round (its time, what
a round launched at the backward leaves exposed, bytes per link class, the strategies the model
picks). At the first size where the round outgrows the backward (overlap stops hiding it), the
same round is simulated with every other placement, to say what the model finds would move it.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from conduit_dist.sim.rounds import SimRound, Workload, simulate
from conduit_dist.sim.tokens import TokenWorkload, simulate_tokens
from conduit_dist.sim.topology import SimTopology

# DQN-like: small items, a high replay ratio, gradients in the round (colocated, local)
DQN = Workload(
    "dqn", record_bytes=64, puts_per_rank=8, batch_per_learner=256, reduce_numel=17_282,
    backward_ms=0.5, overlap="flight",
    notes="CartPole-sized MLP; 32 samples per item put; the round started after the backward",
)  # fmt: skip
# Atari-like: 56 KB frames, one learner per node fed by 7 actors (disaggregated, round-robin)
ATARI = Workload(
    "atari", record_bytes=56_472, puts_per_rank=32, batch_per_learner=256, learner_every=8,
    producers="actors", placement="round_robin", tier="pinned", backward_ms=5.0,
    notes="Nature-CNN learner on 8 GPUs' worth of actors per node; frames in pinned host memory",
)  # fmt: skip
# PPO-like: each rank's rollout stays on its shard, minibatches drawn over all of them
PPO = Workload(
    "ppo", record_bytes=320, puts_per_rank=2048, batch_per_learner=512, backward_ms=3.0,
    notes="2,048-step rollouts of 64-float observations per rank, minibatches of 512",
)  # fmt: skip


def step_ms(params_b: float, w: TokenWorkload, tflops: float = 400.0) -> float:
    """A learner's step on its share of the batch: ``6 * params * tokens`` FLOPs (forward and
    backward) at ``tflops`` sustained (about 40% of an H100's dense bf16 peak)."""
    mean = w.median_tokens * float(np.exp(w.sigma**2 / 2))  # lognormal mean
    tokens = w.groups_per_learner * w.group_size * mean
    return 6 * params_b * 1e9 * tokens / (tflops * 1e12) * 1e3


# LLM RL (GRPO-like, TokenPlane): half the GPUs generate, half learn; 4 prompts x 16 samples per
# learner per step, lognormal lengths (median 600 tokens, capped at 8,192), one version a step
_LLM = TokenWorkload("llm", params_b=1.0)
LLMS = tuple(
    replace(_LLM, name=f"llm-{b}b", params_b=float(b), step_ms=step_ms(b, _LLM)) for b in (1, 8, 70)
)
WORKLOADS = (DQN, ATARI, PPO, *LLMS)
WORLDS = tuple(2**k for k in range(3, 13))  # 8 .. 4,096
PLACEMENT_LIMIT = 1024  # bandwidth_aware's planner is quadratic: tried up to this many ranks


def run(topo: SimTopology, world: int, w: Workload | TokenWorkload) -> SimRound:
    """One simulated round of a replay (:class:`Workload`) or token workload."""
    if isinstance(w, TokenWorkload):
        return simulate_tokens(topo, world, w)
    return simulate(topo, world, w)


def _alternatives(topo: SimTopology, world: int, w: Workload) -> dict[str, float]:
    """The same round with every other placement and every other declared tier (ms)."""
    out = {}
    for placement in ("local", "round_robin", "bandwidth_aware"):
        if placement == w.placement or (placement == "bandwidth_aware" and world > PLACEMENT_LIMIT):
            continue
        alt = simulate(topo, world, replace(w, placement=placement))
        out[f"placement={placement}"] = alt.seconds * 1e3
    for tier in topo.tier_gbps:
        if tier != w.tier:
            out[f"tier={tier}"] = simulate(topo, world, replace(w, tier=tier)).seconds * 1e3
    return out


def project(topo: SimTopology, workloads=WORKLOADS, worlds=WORLDS) -> tuple[list[dict], list[dict]]:
    """Simulate every workload at every size on ``topo``.

    Returns:
        ``(rows, crossovers)``: a row per workload and size (``round_ms``, ``exposed_ms``,
        ``backward_ms``, ``bytes`` per link class, ``strategies``, ``ms`` per exchange), and per
        workload the first size where the round exceeds the backward (the learner's step) with
        the model's dominant term there and, for replay workloads, the round with every other
        placement and tier (``alternatives``, ms) and the best of them (``faster``);
        ``world: None`` if it never does (then ``round_over_backward`` at the largest size).
    """
    rows, crossovers = [], []
    for w in workloads:
        cross = None
        for world in worlds:
            t0 = time.perf_counter()
            r = run(topo, world, w)
            rows.append({
                "workload": w.name, "topology": topo.name, "world": world,
                "round_ms": r.seconds * 1e3, "exposed_ms": r.exposed_s * 1e3,
                "backward_ms": r.backward_s * 1e3, "schedule": r.schedule,
                "bytes": r.bytes_by_link(),
                "strategies": {e.op: e.strategy for e in r.exchanges},
                "ms": {e.op: e.seconds * 1e3 for e in r.exchanges} | {"host": r.cpu_s * 1e3},
                "sim_s": time.perf_counter() - t0,
            })  # fmt: skip
            if cross is None and r.seconds > r.backward_s:
                cross = {"workload": w.name, "world": world, "round_ms": r.seconds * 1e3,
                         "dominant": list(r.dominant())}  # fmt: skip
                if isinstance(w, Workload):
                    alts = _alternatives(topo, world, w)
                    best = min(alts, key=alts.get, default=None)
                    cross |= {"placement": w.placement, "tier": w.tier, "alternatives": alts,
                              "faster": best
                              if best and alts[best] < r.seconds * 1e3 else None}  # fmt: skip
        last = rows[-1]
        crossovers.append(cross or {"workload": w.name, "world": None,
                                    "round_over_backward": last["round_ms"] / last["backward_ms"],
                                    "dominant": list(r.dominant())})  # fmt: skip
    return rows, crossovers


def plot(rows: list[dict], path: str) -> None:
    """Round time and backward per workload against ranks (log-log): one column per machine,
    replay workloads above, LLM-RL (token) workloads below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    topos = sorted({r["topology"] for r in rows})
    names = list(dict.fromkeys(r["workload"] for r in rows))
    groups = [
        [n for n in names if not n.startswith("llm")],
        [n for n in names if n.startswith("llm")],
    ]
    groups = [g for g in groups if g]
    fig, axes = plt.subplots(
        len(groups), len(topos), figsize=(6 * len(topos), 4.2 * len(groups)), squeeze=False
    )
    for row, group in zip(axes, groups):
        for ax, topo in zip(row, topos):
            for i, name in enumerate(group):
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
            ax.set_title(f"{topo}: a round hides while it is under the backward", fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
