"""Step (d) of the GPU check: ``train.py device=cuda`` for a few thousand env steps.

Each run is the real ``train.py`` (in the process of ``train_inproc.py``, under ``torchrun`` for
several ranks; 2 ranks share one GPU with gloo carrying the CUDA tensors, unless
``GPU_CHECK_CUDA_BACKEND=nccl``: one GPU per rank), with its summary written to JSON and
checked: DQN and PPO took every env step and made learner updates, PPO's items all within its
policy-age bound; GRPO trained on every response asked for within its policy-age bound. For DQN
the plane's rows and first tier must be on the GPU, and each training iteration's host syncs
(counted on every rank by ``train_inproc.py --count-syncs``) stay within
:data:`TORCH_SYNCS` and :data:`LIBRARY_SYNCS`.

    python scripts/gpu_check/train_run.py NAME NPROC [OVERRIDE ...]
    python scripts/gpu_check/train_run.py dqn-2 2 total_env_steps=3000
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import DEVICE, DRY, check, ok, tier

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
COMMON = (
    "logger=none",
    "logger.log_every=10",
    "plane.calibrate=false",  # declared link numbers: no probing at start-up
    "target_return=null",
)
TIMEOUT_S = 300  # one run (the shell's step limit is the real bound)
KEEP = (  # the summary's numbers the check's own summary line carries
    "env_steps", "env_steps_per_s", "return_100", "learner_steps", "store/host_syncs",
    "trained_samples", "steps", "reward_100", "max_policy_age_seen", "gen_tokens_per_s",
)  # fmt: skip

# Host syncs one training iteration of DQN (train.py's default experiment: prioritized 3-step
# replay, 8 envs a rank) may make in the steady state:
TORCH_SYNCS = 2
# torch's own, both in the actor's act (rl/dqn.DQN.act), because gymnasium steps on the host:
# the observations going up (obs.to(device), a copy from pageable memory) and the greedy actions
# coming down (.cpu()); none when every action explores. The learner's fetch (rows composed on
# the GPU, indices and trailers uploaded without blocking), loss, update_priorities (the GPU
# |TD errors| copied to pinned memory without blocking), backward and optimizer step (Adam's
# step counts live on the host) make none. CUDA tensors over gloo (2 ranks on one GPU) are
# synchronised on gloo's own threads, not the iteration's.
LIBRARY_SYNCS = 1
# conduit_dist.syncs, only when the GPU is behind the host: the last iteration's priorities not
# landed in pinned memory when this fetch queues them, or a put reusing a staging buffer whose
# upload has not run. The act's copies wait for the learner's stream every iteration, so both
# have passed by then: 0 expected.
STEADY_AFTER = 20  # learning iterations before the budget applies (the pools reach their size)


def command(nproc: int, overrides: list[str], out: Path, count: bool) -> list[str]:
    """``train_inproc.py`` (under ``torchrun --standalone`` for ``nproc >= 1``, plain
    ``python`` for ``nproc == 0``) with the check's overrides."""
    launch = [sys.executable]
    if nproc:
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [
        *launch,
        str(HERE / "train_inproc.py"),
        str(out / "inproc"),
        *(["--count-syncs"] if count else []),
        f"device={DEVICE}",
        *COMMON,
        *overrides,
        f"logger.summary_path={out / 'summary.json'}",
        f"hydra.run.dir={out}",
    ]


def kind_of(overrides: list[str]) -> str:
    """``dqn``, ``ppo`` or ``grpo``, from the experiment or algo override."""
    for o in overrides:
        if o in ("experiment=grpo", "algo=grpo"):
            return "grpo"
        if o in ("experiment=cartpole_ppo", "algo=ppo"):
            return "ppo"
    return "dqn"


def check_summary(name: str, kind: str, summary: dict, overrides: list[str]) -> str:
    """Check a run's summary; returns the line's description of it."""
    steps = next(int(o.split("=")[1]) for o in overrides if o.startswith("total_env_steps="))
    if kind == "grpo":  # total_env_steps counts responses trained on
        check(summary["trained_samples"] >= steps, f"{name}: trained on {summary}")
        check(summary["steps"] >= 1, f"{name}: no optimiser step in {summary}")
        check(summary["max_policy_age_seen"] <= 1, f"{name}: policy age {summary}")
        return (
            f"{summary['trained_samples']} responses in {summary['steps']} steps, reward "
            f"{summary['reward_first_100']:.3f} -> {summary['reward_100']:.3f}, policy age "
            f"<= {summary['max_policy_age_seen']}"
        )
    check(summary["env_steps"] >= steps, f"{name}: {summary['env_steps']} env steps of {steps}")
    if kind == "ppo":  # every item within algo.ppo.max_policy_age=0
        check(summary["max_policy_age_seen"] == 0, f"{name}: policy age {summary}")
        learned = summary["train/policy_version"] >= 1  # rank 0 learns: one per update
    else:  # DQN: rank 0 is a learner in both modes
        learned = summary["learner_steps"] > 0
    check(learned, f"{name}: no learner update in {summary}")
    ret = summary["return_100"]
    return (
        f"{summary['env_steps']} env steps ({summary['env_steps_per_s']:.0f}/s), last-100 "
        f"return {ret if not math.isnan(ret) else 'n/a'}"
    )


def check_dqn(name: str, reports: list[dict], bulk: str) -> tuple[str, dict]:
    """Every rank's plane on its device (``cuda:<rank>`` where NCCL joins ranks on their own
    GPUs, else the one GPU), its rows and first tier there, its bulk rows by ``bulk``, and its
    iterations' host syncs within the budget; returns the line's description and the numbers."""
    worst = {"torch": 0, "library": 0}
    means = []
    for rank, r in enumerate(reports):
        dev = "cpu" if DRY else f"cuda:{rank if bulk == 'nccl' else 0}"
        check(r.get("device") == dev and r.get("rows") == dev and r.get("bulk") == bulk,
              f"{name}, rank {rank}: batches on {r.get('device')}, rows on {r.get('rows')}, "
              f"bulk rows by {r.get('bulk')}; expected {dev}, {dev}, {bulk}")  # fmt: skip
        check(r.get("first_tier") == tier("device"),
              f"{name}, rank {rank}: first tier {r.get('first_tier')!r}")  # fmt: skip
        steady = [it for it in r["iterations"] if it[2]][STEADY_AFTER:]
        check(bool(steady), f"{name}, rank {rank}: no steady learning iteration to count")
        t_max, l_max = max(it[0] for it in steady), max(it[1] for it in steady)
        check(
            t_max <= TORCH_SYNCS and l_max <= LIBRARY_SYNCS,
            f"{name}, rank {rank}: host syncs in one iteration up to torch {t_max} (budget "
            f"{TORCH_SYNCS}), library {l_max} (budget {LIBRARY_SYNCS}); library reasons "
            f"{r['reasons']}; torch's at {r['sites']}",
        )
        worst = {"torch": max(worst["torch"], t_max), "library": max(worst["library"], l_max)}
        means.append(sum(it[0] + it[1] for it in steady) / len(steady))
    r0 = reports[0]
    line = (
        f"rows and first tier ({r0['first_tier']}) on {', '.join(r['rows'] for r in reports)}, "
        f"bulk rows by {bulk}; host syncs per iteration "
        f"(mean, ranks) {', '.join(f'{m:.2f}' for m in means)}, most torch {worst['torch']} "
        f"(budget {TORCH_SYNCS}) and library {worst['library']} (budget {LIBRARY_SYNCS})"
    )
    return line, {"syncs_per_iteration": means, "torch_syncs_max": worst["torch"],
                  "library_syncs_max": worst["library"]}  # fmt: skip


def main() -> None:
    """Run one ``train.py`` job and check its summary."""
    name, nproc, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    kind = kind_of(overrides)
    out = Path(tempfile.mkdtemp(prefix=f"train-{name}-", dir=os.environ.get("GPU_CHECK_OUT")))
    env = dict(os.environ)
    backend = env.get("GPU_CHECK_CUDA_BACKEND", "gloo")
    if nproc > 1 and not DRY:  # ranks sharing one GPU: NCCL refuses that, gloo carries CUDA
        env["CONDUIT_CUDA_BACKEND"] = backend
    t0 = time.perf_counter()
    res = subprocess.run(
        command(nproc, overrides, out, kind == "dqn"), cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        sys.stderr.write(res.stdout[-6000:] + res.stderr[-6000:])
        raise SystemExit(f"train.py {name}: exit code {res.returncode} after {wall:.0f} s")
    summary = json.loads((out / "summary.json").read_text())
    line = check_summary(name, kind, summary, overrides)
    numbers: dict[str, object] = {}
    if kind == "dqn":
        reports = [json.loads(p.read_text()) for p in sorted(out.glob("inproc.rank*.json"))]
        check(len(reports) == max(nproc, 1), f"{name}: {len(reports)} rank reports")
        bulk = "none" if nproc <= 1 else ("host" if DRY else backend)
        extra, numbers = check_dqn(name, reports, bulk)
        line += "; " + extra
    where = f", CUDA tensors by {backend}" if nproc > 1 and not DRY else ""
    ok(
        f"d.train.{name}",
        f"train.py device={DEVICE} {' '.join(overrides)} ({max(nproc, 1)} rank(s){where}): "
        f"{line}; {wall:.0f} s",
        **{k: v for k, v in summary.items() if k in KEEP and math.isfinite(v)},
        **numbers,
        run_wall_s=wall,
    )


if __name__ == "__main__":
    main()
