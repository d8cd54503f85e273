"""Producers outside the job (``cd.attach``): attached mid-run, killed with SIGKILL, reattached
after a broken connection, on 2 learner ranks over gloo; every acknowledged group delivered
exactly once, a dead producer's incomplete groups dropped and counted by id, none twice."""

from __future__ import annotations

import collections
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from attached_producer import MAX_LEN, member
from dist_utils import child_env, run_ranks

import conduit_dist as cd

G = 4
SCRIPT = str(Path(__file__).with_name("attached_producer.py"))
TIMEOUT_S, GRACE_S = 5.0, 1.5


def make_spec() -> cd.TokenSpec:
    return cd.TokenSpec(
        {
            "tokens": cd.Ragged(torch.int32, MAX_LEN),
            "logprobs": cd.Ragged(torch.float32, MAX_LEN),
            "loss_mask": cd.Ragged(torch.bool, MAX_LEN),
            "reward": ((), torch.float32),
        },
        group_size=G,
    )


class Producer:
    """A producer process; its stdout lines read by a thread (never blocking the rounds)."""

    def __init__(self, run_dir: str, pid: str, ingress: int, kind: str, start: int, n: int,
                 mode: str = "whole") -> None:  # fmt: skip
        args = [run_dir, pid, str(ingress), kind, str(start), str(n), mode, str(G)]
        self.proc = subprocess.Popen(
            [sys.executable, SCRIPT, *args], stdout=subprocess.PIPE, text=True, env=child_env()
        )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.put(json.loads(line))

    def line(self, timeout: float | None = None) -> dict | None:
        try:
            return self.lines.get(timeout=timeout) if timeout else self.lines.get_nowait()
        except queue.Empty:
            return None


def _same_as_put(mb: cd.MicroBatch) -> list[int]:
    """Each sequence's group id, its content checked against what its producer put."""
    cu, gids = mb.cu_seqlens.tolist(), mb["group"].tolist()
    members = collections.defaultdict(list)
    for i, g in enumerate(gids):
        got = {k: mb[k][cu[i] : cu[i + 1]] for k in ("tokens", "logprobs", "loss_mask")}
        got["reward"] = mb["reward"][i]
        members[g].append(got)
    for g, seqs in members.items():
        want = [member(g, m) for m in range(G)]
        assert len(seqs) == G, (g, len(seqs))
        for s in seqs:  # one of the group's members, byte for byte
            assert any(all(torch.equal(s[k], w[k]) for k in s) for w in want), g
    return list(members)


def _tokens(rank: int, world: int, run_dir: str) -> dict:
    transport = cd.TransportConfig(timeout_s=20)
    with cd.TokenPlane(make_spec(), 512, 512 * MAX_LEN, transport=transport) as tp:
        tp.open_ingress(run_dir, timeout_s=TIMEOUT_S, grace_s=GRACE_S)
        dist.barrier()  # both endpoints are written
        prods: dict[str, Producer] = {}
        if rank == 0:
            prods["a"] = Producer(run_dir, "a", 0, "tokens", 0, 12)
            prods["b"] = Producer(run_dir, "b", 1, "tokens", 100, 12)
            prods["d"] = Producer(run_dir, "d", 1, "tokens", 300, 4, "partial")
        seen, after_kill, killed_at = [], [], None
        for step in range(17):  # 34 whole groups, 2 a fetch
            if rank == 0 and step == 3:  # a third producer attaches mid-run
                prods["c"] = Producer(run_dir, "c", 0, "tokens", 200, 6)
            if rank == 0 and killed_at is None and prods["d"].line() is not None:
                os.kill(prods["d"].proc.pid, signal.SIGKILL)  # all of it acknowledged
                killed_at = time.monotonic()
            t = time.monotonic()
            for mb in tp.fetch(2, 2048, wait_s=60):
                seen += _same_as_put(mb)
            if killed_at is not None:
                after_kill.append(time.monotonic() - t)
        # the producers are gone (closed, or dead after the grace): every rank agrees
        deadline = time.monotonic() + TIMEOUT_S + GRACE_S + 10
        while True:
            tp.drain_ingress()
            gone = all(a["state"] in ("closed", "dead") for a in tp.ledger().values())
            flag = torch.tensor([int(gone or time.monotonic() > deadline)])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            if flag.item():
                break
            time.sleep(0.1)
        done = {k: p.line(timeout=10) for k, p in prods.items() if k != "d"}
        for p in prods.values():
            p.proc.kill()
            p.proc.wait()
        return {"seen": seen, "ledger": tp.ledger(), "after_kill": after_kill,
                "killed": killed_at is not None, "done": done, "stats": tp.stats()}  # fmt: skip


def test_attached_producers_join_and_die_and_every_acknowledged_group_arrives_once(tmp_path):
    got = run_ranks(_tokens, 2, str(tmp_path), timeout_s=180)
    seen = collections.Counter(g for r in got.values() for g in r["seen"])
    whole = [*range(12), *range(100, 112), *range(200, 206), *range(300, 304)]
    assert sorted(seen) == whole and max(seen.values()) == 1  # each once, on one learner
    ledger = {pid: a for r in got.values() for pid, a in r["ledger"].items()}
    assert set(ledger) == {"a", "b", "c", "d"}
    assert ledger["d"]["state"] == "dead" and ledger["d"]["dropped"] == [304]
    assert "grace_s" in ledger["d"]["dropped_why"]
    for pid, n in (("a", 12), ("b", 12), ("c", 6)):
        assert ledger[pid]["state"] == "closed" and ledger[pid]["dropped"] == []
        assert ledger[pid]["acked"] == ledger[pid]["put"] == n and ledger[pid]["delivered"] == n
    assert ledger["d"]["acked"] == 5 and ledger["d"]["delivered"] == 4  # its 4 whole groups
    assert got[0]["killed"] and got[0]["after_kill"]
    assert max(got[0]["after_kill"]) < TIMEOUT_S + 3  # the learners went on
    for pid, line in got[0]["done"].items():  # each flushed: every put acknowledged
        assert line is not None and line["done"] == pid and line["acked"] > 0, (pid, line)
    assert got[1]["stats"]["attached_dropped_groups"] == 1
