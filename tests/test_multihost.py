"""Two emulated hosts (network namespaces, veth shaped with tc tbf): topology and a real net link.

Skips where namespaces cannot be made (not root, no iproute2); always removes what it created.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def _sh(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("emulated hosts need root and iproute2")
    a, b = f"cdtA{os.getpid()}", f"cdtB{os.getpid()}"
    try:
        if _sh("ip", "netns", "add", a).returncode != 0:
            pytest.skip("cannot create network namespaces here")
        steps = [
            ("ip", "netns", "add", b),
            (
                "ip",
                "link",
                "add",
                "va",
                "netns",
                a,
                "type",
                "veth",
                "peer",
                "name",
                "vb",
                "netns",
                b,
            ),
        ]
        for ns, dev, addr in ((a, "va", "10.214.0.1/24"), (b, "vb", "10.214.0.2/24")):
            tbf = f"tc qdisc add dev {dev} root tbf rate 400mbit burst 256kb latency 100ms"
            steps += [
                ("ip", "-n", ns, "addr", "add", addr, "dev", dev),
                ("ip", "-n", ns, "link", "set", "lo", "up"),
                ("ip", "-n", ns, "link", "set", dev, "up"),
                ("ip", "netns", "exec", ns, *tbf.split()),
            ]
        for step in steps:
            res = _sh(*step)
            if res.returncode != 0:
                pytest.skip(f"namespace set-up failed: {' '.join(step)}: {res.stderr.strip()}")
        yield a, b
    finally:
        _sh("ip", "netns", "del", a)
        _sh("ip", "netns", "del", b)


def _launch(ns: str, host: str, iface: str, node: int, port: int) -> subprocess.Popen:
    inner = (
        f"hostname {host}; GLOO_SOCKET_IFNAME={iface} PYTHONPATH={TESTS} exec {sys.executable} "
        f"-m torch.distributed.run --nnodes=2 --node_rank={node} --nproc_per_node=1 "
        f"--master_addr=10.214.0.1 --master_port={port} {TESTS / 'multihost_prog.py'}"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", inner],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_two_hosts_see_a_net_link_and_every_item_lands_once(two_hosts):
    a, b = two_hosts
    port = 29500 + os.getpid() % 400
    procs = [_launch(a, "hostA", "va", 0, port), _launch(b, "hostB", "vb", 1, port)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    for o in outs:
        assert o["hosts"] == ["hostA", "hostB"] and o["link"] == "net"
        assert o["strategies"]  # the round's exchanges went through the transport
    put = sorted(x for o in outs for x in o["put"])
    held = sorted(x for o in outs for x in o["held"])
    assert held == put
