"""Two emulated hosts of two ranks each (../shared/multihost.md): network namespaces joined by a
veth pair, each host's own hostname (``unshare --uts``), ``torchrun --nnodes=2 --node_rank=i
--nproc_per_node=2`` in each, gloo over the veth link.

Checks host discovery (two hosts of two ranks, also when both hosts share one hostname: torchrun's
node rank tells them apart), the link classes the bandwidth model prices, that every item put
lands exactly once, and that ``bandwidth_aware`` sends fewer bytes across hosts than
``round_robin`` for the same puts and fetches.

Skips where namespaces cannot be made (not root, no ``ip`` or ``unshare``); always removes the
namespaces it made, and kills what it launched, also on failure or timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from dist_utils import ROOT, child_env

TESTS = Path(__file__).resolve().parent
PROG = TESTS / "multihost_plane_prog.py"
PLACEMENTS = ("round_robin", "bandwidth_aware")
LAUNCH_S = 120  # both hosts' torchrun must be done by then (about 20 s here)


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def _two_hosts() -> Iterator[list[tuple[str, str, str]]]:
    """Two namespaces joined by a veth pair: ``[(namespace, interface, address)] * 2``."""
    if os.geteuid() != 0:
        pytest.skip("emulated hosts need root (network namespaces)")
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            pytest.skip(f"emulated hosts need {tool!r}, not found on PATH")
    tag = uuid.uuid4().hex[:8]
    subnet = f"10.213.{os.getpid() % 250}"
    hosts = [(f"cdA{tag}", "va", f"{subnet}.1"), (f"cdB{tag}", "vb", f"{subnet}.2")]
    made: list[str] = []
    try:
        for ns, _, _ in hosts:
            res = _ip("netns", "add", ns)
            if res.returncode != 0:
                pytest.skip(f"cannot create network namespaces here: {res.stderr.strip()}")
            made.append(ns)
        (a, va, _), (b, vb, _) = hosts
        steps = [("link", "add", va, "netns", a, "type", "veth", "peer", "name", vb, "netns", b)]
        for ns, dev, addr in hosts:
            steps += [
                ("-n", ns, "addr", "add", f"{addr}/24", "dev", dev),
                ("-n", ns, "link", "set", "lo", "up"),
                ("-n", ns, "link", "set", dev, "up"),
            ]
        for step in steps:
            res = _ip(*step)
            if res.returncode != 0:
                pytest.skip(f"namespace set-up failed: ip {' '.join(step)}: {res.stderr.strip()}")
        yield hosts
    finally:
        for ns in made:
            _kill_inside(ns)
            _ip("netns", "del", ns)


def _kill_inside(ns: str) -> None:
    """SIGKILL what still runs in namespace ``ns`` (only this test's processes run there: ranks
    that torchrun started in sessions of their own outlive a killed torchrun)."""
    res = _ip("netns", "pids", ns)
    for pid in res.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def _launch(hosts, names: tuple[str, str], out: Path) -> dict[int, dict]:
    """Both hosts' torchrun; returns each rank's JSON. Kills both on failure or timeout."""
    master = hosts[0][2]
    procs, logs = [], []
    try:
        for node, ((ns, dev, _), name) in enumerate(zip(hosts, names, strict=True)):
            torchrun = (
                f"{sys.executable} -m torch.distributed.run --nnodes=2 --node_rank={node} "
                f"--nproc_per_node=2 --master_addr={master} --master_port=29500"
            )
            inner = f"hostname {name} && exec {torchrun} {PROG} {out} {' '.join(PLACEMENTS)}"
            env = child_env(PYTHONPATH=f"{ROOT}{os.pathsep}{TESTS}", GLOO_SOCKET_IFNAME=dev)
            log = open(out / f"node{node}.log", "w")  # noqa: SIM115 - closed below
            logs.append(log)
            cmd = ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", inner]
            procs.append(
                subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            )
        deadline = time.monotonic() + LAUNCH_S
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"the two hosts did not finish within {LAUNCH_S}s:\n{_tails(out)}")
        codes = [p.returncode for p in procs]
        assert codes == [0, 0], f"torchrun exit codes {codes}:\n{_tails(out)}"
    finally:
        for p in procs:  # torchrun stops its ranks on SIGTERM; what is left is killed with
            if p.poll() is None:  # the namespace (_kill_inside)
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=15)
        for log in logs:
            log.close()
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(4)}


def _tails(out: Path) -> str:
    return "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(out.glob("*.log")))


@pytest.mark.parametrize(
    "names", [("hostA", "hostB"), ("trainer", "trainer")], ids=["own hostnames", "one hostname"]
)
def test_two_hosts_of_two_ranks_discover_link_classes_and_keep_traffic_local(names, tmp_path):
    with _two_hosts() as hosts:
        ranks = _launch(hosts, names, tmp_path)
    assert [ranks[r]["hostname"] for r in range(4)] == [names[0]] * 2 + [names[1]] * 2
    keys = [f"node0@{names[0]}"] * 2 + [f"node1@{names[1]}"] * 2
    for r, got in ranks.items():
        for placement in PLACEMENTS:
            topo = got[placement]
            assert topo["hosts"] == keys, (r, topo["hosts"])  # also when the hostnames agree
            assert topo["host_of"] == [0, 0, 1, 1]
            # self 0, same host 1, across hosts 2: the classes the bandwidth model prices
            assert topo["links"] == [[0, 1, 2, 2], [1, 0, 2, 2], [2, 2, 0, 1], [2, 2, 1, 0]]
            assert topo["strategies"]  # the rounds' exchanges went through the transport
    for placement in PLACEMENTS:  # every item put lands exactly once
        put = sorted(x for got in ranks.values() for x in got[placement]["put"])
        held = sorted(x for got in ranks.values() for x in got[placement]["held"])
        assert held == put, placement
    net = {p: sum(got[p]["sent"]["net"] for got in ranks.values()) for p in PLACEMENTS}
    # round_robin spreads every rank's puts over both hosts; bandwidth_aware keeps them on
    # their rank (colocated), so only the learners' draws from the other host cross
    assert 0 < net["bandwidth_aware"] < 0.6 * net["round_robin"], net
