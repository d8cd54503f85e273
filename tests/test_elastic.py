"""A lost host under an elastic rendezvous (../shared/multihost.md): two emulated hosts of two
learner ranks each (``torchrun --nnodes=1:2``, c10d rendezvous on host A), a producer attached
from outside the job, host B killed with SIGKILL mid-run. The survivors' round fails naming
the lost ranks, torchrun restarts them on host A alone, ``examples/elastic_tokens.py``
restores the last checkpoint onto world size 2 and reopens its ingresses; the producer finds
them by itself. Checked: the resumed timeline (the first run's steps before the checkpoint,
then the second run's) holds no group twice and every group acknowledged by the checkpoint;
the ledger's ``lost`` equals the puts acknowledged after the checkpoint and before the loss,
and none of those is delivered.

Skips where namespaces cannot be made; always removes them and what runs in them."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_utils import ROOT, child_env

from conduit_dist.bench.hosts import EmulatedHosts, HostsUnavailable, kill_host, start_elastic

EXAMPLE = ROOT / "examples" / "elastic_tokens.py"
PRODUCER = ROOT / "tests" / "attached_producer.py"
STEPS = 20


def _rows(run: Path, pattern: str) -> list[dict]:
    return [json.loads(x) for f in run.glob(pattern) for x in f.read_text().splitlines()]


def _step(run: Path) -> int:
    try:
        return json.loads((run / "ckpt-step.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return -1


def test_a_lost_host_resumes_onto_the_survivor_and_the_ledger_counts_what_was_lost(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    env = child_env()
    try:
        hosts_cm = EmulatedHosts()
        hosts = hosts_cm.__enter__()
    except HostsUnavailable as exc:
        pytest.skip(str(exc))
    producer = None
    try:
        procs = start_elastic(hosts, [str(EXAMPLE), str(run), str(STEPS)], 2, tmp_path, env)
        ns_a = hosts.hosts[0][0]
        with open(tmp_path / "producer.log", "w") as log:  # outside the job, on host A
            producer = subprocess.Popen(
                ["ip", "netns", "exec", ns_a, sys.executable, str(PRODUCER), str(run / "ingress"),
                 "p0", "0", "tokens", "0", "1000000", "stream"],
                stdout=log, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
        deadline = time.monotonic() + 120
        while _step(run) < 6 and time.monotonic() < deadline:  # a checkpoint, then a bit more
            time.sleep(0.2)
        assert _step(run) >= 6, (tmp_path / "node0.log").read_text()[-3000:]
        time.sleep(1.5)
        kill_host(hosts, 1)
        procs[0].wait(timeout=240)
        out = (tmp_path / "node0.log").read_text()
        assert procs[0].returncode == 0, out[-4000:]
    finally:
        if producer is not None:
            producer.kill()
            producer.wait()
        hosts_cm.__exit__(None, None, None)
    r0, r1 = _rows(run, "delivered-r0-*.jsonl"), _rows(run, "delivered-r1-*.jsonl")
    assert r1, out[-4000:]  # torchrun restarted the ranks once
    resumed = min(r["step"] for r in r1)
    assert {r["world"] for r in r0} == {4} and {r["world"] for r in r1} == {2}
    timeline = [g for r in r0 if r["step"] < resumed for g in r["groups"]]
    timeline += [g for r in r1 for g in r["groups"]]
    seen = collections.Counter(timeline)
    assert max(seen.values()) == 1  # no group twice in the run that went on
    ledgers = [json.loads(f.read_text())["ledger"]["p0"] for f in run.glob("ledger-r1-*.json")]
    led = max(ledgers, key=lambda a: a["attaches"])  # the rank it reattached to
    assert led["attaches"] == 2 and led["lost"] > 0
    through = int(led["lost_why"].split("puts ")[1].split("..")[0]) - 1  # the checkpoint's
    acks = [json.loads(x) for x in (tmp_path / "producer.log").read_text().splitlines()
            if x.startswith("{")]  # fmt: skip
    lost = [a["acked"] for a in acks if a["attaches"] == 1 and a["seq"] > through]
    assert led["lost"] == len(lost)  # exactly what was acknowledged after the checkpoint
    assert not any(g in seen for g in lost)  # and none of it delivered in the resumed run
    kept = [a["acked"] for a in acks if a["seq"] <= through]
    assert all(g in seen for g in kept)  # everything the checkpoint held was delivered
    assert any(a["attaches"] == 2 for a in acks)  # the producer went on with the new job
    assert "never reached round" in out  # the survivors' round named the lost ranks
