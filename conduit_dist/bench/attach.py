"""``torchrun --standalone --nproc_per_node=2 -m conduit_dist.bench attach``: producers that
attach to a running ``TokenPlane`` and leave, against a fixed set of them.

Every rank learns (``fetch`` of ``--groups`` GRPO-shaped groups a step, then ``--compute-ms`` of
work off the CPU, a sleep); producers are processes outside the job (``cd.attach``,
``bench/attach_producer.py``) started by rank 0, each attached to one rank's ingress. Two
phases, each on a fresh plane:

- ``fixed``: ``--producers`` producers attached before the first step, putting a group every
  ``--interval-ms`` until the phase ends (the fairest baseline: the same producers, the same
  rate, nobody joining or leaving);
- ``churn``: as many producers attached at a time, but each puts ``--groups-per-producer``
  groups and leaves (``close``); a standby (a producer process started and imported before
  the phase, as many as the phase needs) attaches in its place at once, so the phase measures
  joining and leaving, not interpreter starts on the learners' cores.

Timing: a step is ``fetch`` plus the compute (the slowest rank's); ``attach_to_first_delivery_s``
is, for each producer of the churn phase, from just before its ``attach`` call to the end of the
first ``fetch`` that delivered one of its groups (``time.monotonic``: one clock for every
process of this host). Checks: every delivered group id once, on one learner; no group
dropped.

Summary: ``attach_to_first_delivery_s`` (median over the churn phase's producers, with the
samples), ``step_ms_fixed`` and ``step_ms_churn`` (medians) and ``churn_over_fixed``."""

from __future__ import annotations

import argparse
import collections
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist

import conduit_dist as cd
from conduit_dist.bench.common import emit, number
from conduit_dist.bench.token_baselines import FIELDS, MAX_LEN
from conduit_dist.threads import start_thread


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m conduit_dist.bench attach")
    p.add_argument("--steps", type=number(int, 2), default=30)
    p.add_argument("--warmup", type=number(int, 0), default=3)
    p.add_argument("--groups", type=number(int, 2), default=8, help="groups a step, global")
    p.add_argument("--group-size", type=number(int, 1), default=8)
    p.add_argument("--median", type=number(float, 16), default=128.0, help="median length")
    p.add_argument("--token-budget", type=number(int, MAX_LEN), default=16_384)
    p.add_argument("--compute-ms", type=number(float, 0), default=40.0)
    p.add_argument("--producers", type=number(int, 1), default=2, help="alive at a time")
    p.add_argument("--interval-ms", type=number(float, 0), default=5.0)
    p.add_argument("--groups-per-producer", type=number(int, 1), default=40,
                   help="churn: groups each producer puts before it leaves")  # fmt: skip
    return p.parse_args(argv)


class _Proc:
    """A producer process on standby (imported, it waits for :meth:`go` before it attaches),
    its JSON lines read by a thread."""

    def __init__(self, args: list[str]) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        cmd = [sys.executable, "-m", "conduit_dist.bench.attach_producer", *args, "1"]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True, env=env
        )
        self.started = self.ready = False
        self.attached = False  # its attach line was read
        self.lines: queue.Queue = queue.Queue()
        start_thread(self._read, "conduit-bench-attach-read", None)

    def go(self) -> None:
        """Let a standby attach now."""
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        self.started = True

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                got = json.loads(line)
                if "standby" in got:
                    self.ready = True
                else:
                    self.attached = self.attached or "attach_t0" in got
                    self.lines.put(got)


def _wait_for(procs: list[_Proc], flag: str, deadline: float) -> None:
    """Wait until every producer's ``flag`` is set, or the ``deadline`` (``time.monotonic``)
    passed: a late producer is reported by the phase's counts, not waited for past it."""
    while time.monotonic() < deadline and not all(getattr(p, flag) for p in procs):
        time.sleep(0.05)


def _phase(a, name: str, run_dir: str, base: int) -> dict:
    """One phase on a fresh plane: step times, delivery times per group, producers' lines."""
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = cd.TokenSpec(
        {n: cd.Ragged(t, MAX_LEN) for n, t in FIELDS} | {"reward": ((), torch.float32)},
        group_size=a.group_size,
    )
    cap = 64 * a.groups * a.group_size
    tp = cd.TokenPlane(spec, cap, cap * int(a.median) * 4)
    procs: list[_Proc] = []
    nxt = [base]

    def start() -> None:
        k = len(procs)
        count = a.groups_per_producer if name == "churn" else 0
        args = [run_dir, f"{name}{k}", str(k % world), str(nxt[0]), str(count),
                str(a.interval_ms / 1e3), str(a.group_size), str(a.median)]  # fmt: skip
        procs.append(_Proc(args))
        nxt[0] += 10_000

    stop = threading.Event()

    def keep() -> None:  # churn: keep --producers attached, a standby goes when one leaves
        while not stop.wait(0.01):
            live = [p for p in procs if p.started and p.proc.poll() is None]
            spare = [p for p in procs if not p.started]
            for p in [p for p in spare if p.ready][: a.producers - len(live)]:
                p.go()
            if not spare:  # more leave than planned: one more (its import is timed)
                start()

    try:
        tp.open_ingress(run_dir, grace_s=5)
        if rank == 0:  # every producer the phase needs, imported first
            need = a.producers
            if name == "churn":
                need = -(-(a.warmup + a.steps) * a.groups // a.groups_per_producer) + 1
            for _ in range(need):
                start()
            deadline = time.monotonic() + 45  # within the other ranks' barrier timeout
            _wait_for(procs, "ready", deadline)
            if name == "fixed":  # attached before the first step (the welcome needs no round)
                for p in procs:  # one that died or is late: producers_attached says so
                    if p.ready and p.proc.poll() is None:
                        p.go()
                _wait_for(procs, "attached", deadline)
        dist.barrier()
        if rank == 0 and name == "churn":
            for p in procs[: a.producers]:
                p.go()
            start_thread(keep, "conduit-bench-attach-keep", None)
        steps, delivered, twice = [], {}, 0
        for i in range(a.warmup + a.steps):
            t = time.monotonic()
            mbs = tp.fetch(a.groups, a.token_budget, wait_s=120)
            got = time.monotonic()
            for mb in mbs:
                for g in set(mb["group"].tolist()):
                    twice += g in delivered  # a group delivered twice to this rank
                    delivered[g] = got
            time.sleep(a.compute_ms / 1e3)
            if i >= a.warmup:
                steps.append(time.monotonic() - t)
        ledger = tp.ledger()
    finally:
        stop.set()
        time.sleep(0.05)  # the keeper's last start, if any, is in procs
        for p in list(procs):
            p.proc.terminate()
        tp.close()
    lines = []
    for p in list(procs):
        try:
            p.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.proc.kill()
        while not p.lines.empty():
            lines.append(p.lines.get())
    return {"steps": steps, "delivered": delivered, "lines": lines, "ledger": ledger,
            "twice": twice}  # fmt: skip


def main(argv: list[str]) -> None:
    """Run both phases (every rank) and print the JSON line last on rank 0."""
    a = _parse(argv)
    cd.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    run_dir = tempfile.mkdtemp(prefix="conduit-attach-") if rank == 0 else ""
    box = [run_dir]
    dist.broadcast_object_list(box, 0)  # a path, not data
    out = {}
    for k, name in enumerate(("fixed", "churn")):
        phase_dir = os.path.join(box[0], name)
        out[name] = _phase(a, name, phase_dir, 10_000_000 * (k + 1))
    steps = {n: torch.tensor(o["steps"], dtype=torch.float64) for n, o in out.items()}
    for t in steps.values():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step: the slowest rank's
    gathered = [None] * world
    dist.all_gather_object(
        gathered, {n: (o["delivered"], o["ledger"], o["twice"]) for n, o in out.items()}
    )
    if rank == 0:
        _report(a, world, steps, gathered, out)
    cd.destroy_distributed()


def _report(a, world: int, steps: dict, gathered: list, out: dict) -> None:
    rows, summary = [], {}
    first_s = []
    for name in ("fixed", "churn"):
        counts = collections.Counter(g for d in gathered for g in d[name][0])
        when = {}
        for d in gathered:
            for g, t in d[name][0].items():
                when[g] = min(t, when.get(g, t))
        ledger = {pid: x for d in gathered for pid, x in d[name][1].items()}
        attaches = [ln for ln in out[name]["lines"] if "attach_t0" in ln]
        if name == "churn":
            for ln in attaches:
                mine = [
                    t for g, t in when.items() if ln["first_gid"] <= g < ln["first_gid"] + 10_000
                ]
                if mine:
                    first_s.append(min(mine) - ln["attach_t0"])
        ms = steps[name] * 1e3
        rows.append({
            "phase": name, "step_ms": statistics.median(ms.tolist()),
            "step_ms_p90": float(ms.quantile(0.9)), "producers_attached": len(attaches),
            "groups_delivered": len(counts),
            "delivered_once": all(v == 1 for v in counts.values())
            and not any(d[name][2] for d in gathered),
            "dropped_groups": sum(len(x["dropped"]) for x in ledger.values()),
            "duplicates": sum(x["duplicates"] for x in ledger.values()),
            "acked_puts": sum(x["acked"] for x in ledger.values()),
        })  # fmt: skip
    summary["attach_to_first_delivery_s"] = statistics.median(first_s) if first_s else None
    summary["attach_to_first_delivery_samples"] = sorted(first_s)
    summary["step_ms_fixed"], summary["step_ms_churn"] = rows[0]["step_ms"], rows[1]["step_ms"]
    summary["churn_over_fixed"] = rows[1]["step_ms"] / rows[0]["step_ms"]
    summary["delivered_once"] = all(r["delivered_once"] for r in rows)
    for r in rows:
        print(f"{r['phase']:>6}: step {r['step_ms']:.1f} ms (p90 {r['step_ms_p90']:.1f}), "
              f"{r['producers_attached']} producers, {r['groups_delivered']} groups, "
              f"delivered once: {r['delivered_once']}", flush=True)  # fmt: skip
    print(f"attach to first delivery: median {summary['attach_to_first_delivery_s']} s over "
          f"{len(first_s)} attaches", flush=True)  # fmt: skip
    emit("attach", rows, summary, world=world, groups=a.groups, group_size=a.group_size,
         median=a.median, compute_ms=a.compute_ms, producers=a.producers,
         interval_ms=a.interval_ms, groups_per_producer=a.groups_per_producer,
         steps=a.steps, warmup=a.warmup)  # fmt: skip
