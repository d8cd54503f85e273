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
from test_tokens import make_spec

import conduit_dist as cd

G = 4
SCRIPT = str(Path(__file__).with_name("attached_producer.py"))
TIMEOUT_S, GRACE_S = 5.0, 1.5


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


def _rows(rank: int, world: int, run_dir: str) -> dict:
    spec = cd.ExperienceSpec({"id": ((), torch.int64), "obs": ((3,), torch.float32)})
    transport = cd.TransportConfig(timeout_s=20)
    plane = cd.DataPlane(spec, 256, sampler="queue", schedule="sync", transport=transport)
    with plane:
        plane.open_ingress(run_dir, timeout_s=TIMEOUT_S, grace_s=GRACE_S)
        dist.barrier()
        prods: dict[str, Producer] = {}
        if rank == 0:
            prods["a"] = Producer(run_dir, "a", 0, "rows", 0, 20)
            prods["b"] = Producer(run_dir, "b", 1, "rows", 100, 20)
            prods["d"] = Producer(run_dir, "d", 1, "rows", 300, 10, "partial")
        seen, killed = [], False
        deadline = time.monotonic() + 60
        for step in range(6):  # 60 rows, 5 a learner a step
            if rank == 0 and step == 1:
                prods["c"] = Producer(run_dir, "c", 0, "rows", 200, 10)
            while plane.stored < 10 and time.monotonic() < deadline:  # the same on every rank
                if rank == 0 and not killed and prods["d"].line() is not None:
                    os.kill(prods["d"].proc.pid, signal.SIGKILL)
                    killed = True
                plane.flush()
                time.sleep(0.02)
            seen += plane.fetch(5)["id"].tolist()
        while True:  # every producer closed or dead, on every rank
            plane.flush()
            gone = all(a["state"] in ("closed", "dead") for a in plane.ledger().values())
            flag = torch.tensor([int(gone or time.monotonic() > deadline)])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            if flag.item():
                break
            time.sleep(0.1)
        for p in prods.values():
            p.proc.kill()
            p.proc.wait()
        return {"seen": seen, "ledger": plane.ledger(), "killed": killed}


def test_attached_row_producers_join_and_die_and_every_acknowledged_row_arrives_once(tmp_path):
    got = run_ranks(_rows, 2, str(tmp_path), timeout_s=180)
    seen = collections.Counter(i for r in got.values() for i in r["seen"])
    rows = [*range(20), *range(100, 120), *range(200, 210), *range(300, 310)]
    assert sorted(seen) == rows and max(seen.values()) == 1
    ledger = {pid: a for r in got.values() for pid, a in r["ledger"].items()}
    assert got[0]["killed"] and ledger["d"]["state"] == "dead" and ledger["d"]["acked"] == 10
    for pid, n in (("a", 20), ("b", 20), ("c", 10)):
        assert ledger[pid]["state"] == "closed" and ledger[pid]["items"] == n, ledger[pid]


def _one_rank(rank: int, world: int, run_dir: str) -> dict:
    """One rank; the producer is a thread of it, the rank draining once it reattached."""
    out: dict = {}
    with cd.TokenPlane(make_spec(), 256, 256 * MAX_LEN) as tp:
        endpoint = tp.open_ingress(run_dir, timeout_s=TIMEOUT_S, grace_s=30)
        model = torch.nn.Linear(3, 2)
        tp.publish_weights(model)

        def produce() -> None:
            from attached_producer import group

            p = cd.attach(run_dir, producer="x", timeout_s=20)
            out["endpoint"] = f"{p.address[0]}:{p.address[1]}"
            for g in range(4):  # sent, stored by the next drain, acknowledged on a dead socket
                p.put(*group(g, range(G)))
            time.sleep(0.5)  # all four read by the ingress
            p._sock.shutdown(2)  # the network fails: nothing acknowledged seen
            time.sleep(0.3)
            p.put(*group(4, range(G)))  # reattaches, sends 1-4 again, then 5
            reattached.set()  # only now does the rank drain: the first four were never acked
            bad, lengths = group(5, range(G))
            p.put({**bad, "tokens": bad["tokens"].float()}, lengths)
            try:
                p.flush()
            except cd.SpecError as exc:
                out["refused"] = str(exc)
            fresh = torch.nn.Linear(3, 2)
            out["pulled"] = p.pull_weights(fresh)
            out["same"] = all(
                torch.equal(a, b)
                for a, b in zip(fresh.state_dict().values(), model.state_dict().values())
            )
            out["resent"], out["attaches"] = p.resent, p.attaches
            # a refusal lost with the connection: the re-sent put is refused again, not acked
            hold.clear()
            p.put({**bad, "tokens": bad["tokens"].float()}, lengths)
            time.sleep(0.5)
            p._sock.shutdown(2)
            time.sleep(0.3)
            p.put(*group(6, range(G)))  # reattaches, re-sends both
            hold.set()
            try:
                p.flush()
            except cd.SpecError as exc:
                out["refused_again"] = str(exc)
            p.close()
            # a new process under the same id goes on after what a shard holds
            q = cd.attach(run_dir, producer="x", timeout_s=20)
            out["resumed_from"] = q.resumed_from
            q.put(*group(7, range(G)))
            q.close()

        reattached, hold = threading.Event(), threading.Event()
        hold.set()
        worker = threading.Thread(target=produce)
        worker.start()
        reattached.wait(30)
        while worker.is_alive():
            if hold.wait(0.01):  # the producer holds the drains while it breaks a connection
                tp.drain_ingress()
        tp.drain_ingress()
        out["stored"] = tp.stats()["groups"]
        out["groups"] = sorted(g for mb in tp.fetch(7, 4096, wait_s=10) for g in _same_as_put(mb))
        out["ledger"] = tp.ledger()["x"]
        out["ingress"] = endpoint
    return out


def test_a_reattached_producer_resends_only_what_was_not_acknowledged_and_nothing_twice(
    tmp_path,
):
    got = run_ranks(_one_rank, 1, str(tmp_path), timeout_s=120)[0]
    assert got["endpoint"] == got["ingress"]
    assert got["attaches"] == 2 and got["resent"] == 4  # the four it never saw acknowledged
    led = got["ledger"]
    assert led["duplicates"] == 4 and led["acked"] == 7 and led["put"] == 9 and led["refused"] == 2
    assert got["stored"] == 7 and got["groups"] == [0, 1, 2, 3, 4, 6, 7]  # each stored once
    assert "'tokens'" in got["refused"] and "int32" in got["refused"]  # the field, expected
    assert "'tokens'" in got["refused_again"]  # the lost refusal is not taken for an ack
    assert got["resumed_from"] == 8  # puts 1-8 answered: the new process starts at 9
    assert got["pulled"] == 1 and got["same"]


def _acked_over_ranks(tp, n: int, timeout: float = 60.0) -> int:
    """Drain until the ranks' ledgers hold ``n`` acknowledged puts in all (collective)."""
    deadline = time.monotonic() + timeout
    while True:
        tp.drain_ingress()
        t = torch.tensor([sum(a["acked"] for a in tp.ledger().values())])
        dist.all_reduce(t)
        if t.item() >= n or time.monotonic() > deadline:
            return int(t.item())
        time.sleep(0.05)


def _crash(rank: int, world: int, run_dir: str, ckpt: str) -> None:
    """Two ranks take the producer's first 4 groups, checkpoint, acknowledge 3 more, and die."""
    tp = cd.TokenPlane(make_spec(), 256, 256 * MAX_LEN, transport=cd.TransportConfig(timeout_s=20))
    tp.open_ingress(run_dir, timeout_s=TIMEOUT_S, grace_s=60)
    dist.barrier()
    assert _acked_over_ranks(tp, 4) == 4
    tp.checkpoint(ckpt)
    if rank == 0:
        Path(run_dir, "go2").touch()
    assert _acked_over_ranks(tp, 7) == 7
    os._exit(17)  # the host is lost: no close, no goodbye to the producer


def _resume(rank: int, world: int, run_dir: str, ckpt: str, restore: bool = True) -> dict:
    """The survivor: restores onto one rank (or starts afresh), opens its ingress where the
    producer looks."""
    with cd.TokenPlane(make_spec(), 256, 256 * MAX_LEN) as tp:
        if restore:
            tp.restore(ckpt)
        tp.open_ingress(run_dir, timeout_s=TIMEOUT_S, grace_s=60)
        files = sorted(f for f in os.listdir(run_dir) if f.startswith("ingress"))
        Path(run_dir, "go3").touch()
        n = 6 if restore else 2
        got = sorted(g for mb in tp.fetch(n, 4096, wait_s=60) for g in _same_as_put(mb))
        deadline = time.monotonic() + 30
        while tp.ledger().get("r", {}).get("state") != "closed" and time.monotonic() < deadline:
            tp.drain_ingress()
            time.sleep(0.05)
        return {"groups": got, "ledger": tp.ledger(), "files": files}


@pytest.mark.parametrize("restore", [True, False], ids=["restored", "afresh"])
def test_a_lost_job_resumes_from_its_checkpoint_and_the_ledger_counts_what_was_lost(
    tmp_path, restore
):
    run_dir, ckpt = str(tmp_path / "run"), str(tmp_path / "ckpt")
    prod = Producer(run_dir, "r", 0, "tokens", 0, 4, "resume")
    try:
        run_ranks(_crash, 2, run_dir, ckpt, timeout_s=120, expect_exit={0: 17, 1: 17})
        got = run_ranks(_resume, 1, run_dir, ckpt, restore, timeout_s=120)[0]
        lines = [prod.line(timeout=30) for _ in range(3)]
    finally:
        prod.proc.kill()
        prod.proc.wait()
    assert lines[0] == {"phase": 1} and lines[1] == {"phase": 2}, lines
    assert lines[2]["done"] == "r" and lines[2]["attaches"] == 2  # it came back by itself
    assert got["files"] == ["ingress-rank0.json"]  # the dead rank 1's endpoint is gone
    # the checkpoint's 4 groups and the 2 put after the restart; the 3 acknowledged between the
    # checkpoint and the loss are gone, and the ledger says so
    led = got["ledger"]["r"]
    if not restore:  # a new job without the old one's ledger: it cannot tell, and says so
        assert got["groups"] == [7, 8]
        assert led["unknown"] == 7 and led["lost"] == 0 and led["last_seq"] == 9
        return
    assert got["groups"] == [0, 1, 2, 3, 7, 8]
    assert led["lost"] == 3 and "5..7" in led["lost_why"] and led["unknown"] == 0
    assert led["acked"] == 6 and led["state"] == "closed" and led["last_seq"] == 9


def _paced(rank: int, world: int, run_dir: str) -> dict:
    """reserve: 2 groups a version, 1 version ahead; the third waits for a publish."""
    out: dict = {}
    with cd.TokenPlane(make_spec(), 64, 64 * MAX_LEN, max_policy_age=1) as tp:
        tp.open_ingress(run_dir, timeout_s=TIMEOUT_S, groups_per_version=2)

        def produce() -> None:
            p = cd.attach(run_dir, producer="q", timeout_s=20)
            out["first"] = [p.reserve(2), p.reserve(2)]  # (0 + 1 + 1) x 2 = 4 at version 0
            out["left"] = p.allowance()
            t0 = time.monotonic()
            out["third"] = p.reserve(1)  # waits for version 1
            out["waited"] = time.monotonic() - t0
            try:
                p.reserve(3)
            except cd.ConfigError as exc:
                out["too_many"] = str(exc)
            p.close()

        worker = threading.Thread(target=produce)
        worker.start()
        deadline = time.monotonic() + 30
        while "left" not in out and time.monotonic() < deadline:
            tp.drain_ingress()
            time.sleep(0.01)
        time.sleep(0.5)
        tp.publish_weights(torch.nn.Linear(2, 2))
        tp.flush()  # a round: the version travels
        while worker.is_alive() and time.monotonic() < deadline:
            tp.drain_ingress()
            time.sleep(0.01)
        worker.join(5)
    return out


def test_reserve_paces_an_attached_producer_by_the_learners_version(tmp_path):
    got = run_ranks(_paced, 1, str(tmp_path), timeout_s=60)[0]
    assert got["first"] == [0, 0] and got["left"] == 0
    assert got["third"] == 1 and got["waited"] >= 0.4  # only once the learners published
    assert "exceed what one version grants (2" in got["too_many"]
