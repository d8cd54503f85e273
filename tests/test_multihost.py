"""Two emulated hosts of two ranks each (../shared/multihost.md): network namespaces joined by a
veth pair, each host's own hostname (``unshare --uts``), ``torchrun --nnodes=2 --node_rank=i
--nproc_per_node=2`` in each, gloo over the veth link.

Checks host discovery (two hosts of two ranks, also when both hosts share one hostname: torchrun's
node rank tells them apart), that ``shared_memory="auto"`` stays off across them (they share one
``/dev/shm`` here), the link classes the bandwidth model prices, that every item put
lands exactly once, and that ``bandwidth_aware`` sends fewer bytes across hosts than
``round_robin`` for the same puts and fetches.

Skips where namespaces cannot be made (not root, no ``ip`` or ``unshare``); always removes the
namespaces it made, and kills what it launched, also on failure or timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from dist_utils import ROOT, child_env

from conduit_dist.bench.hosts import EmulatedHosts, HostsUnavailable

TESTS = Path(__file__).resolve().parent
PROG = TESTS / "multihost_plane_prog.py"
PLACEMENTS = ("round_robin", "bandwidth_aware")
LAUNCH_S = 120  # both hosts' torchrun must be done by then (about 20 s here)


@contextlib.contextmanager
def _two_hosts(names: tuple[str, str]) -> Iterator[EmulatedHosts]:
    """Two emulated hosts (``conduit_dist.bench.hosts``), or a skip where they cannot be made."""
    try:
        with EmulatedHosts(names=names) as hosts:
            yield hosts
    except HostsUnavailable as exc:
        pytest.skip(str(exc))


def _launch(hosts: EmulatedHosts, out: Path) -> dict[int, dict]:
    """Both hosts' torchrun; returns each rank's JSON (a failed or late host fails the test)."""
    env = child_env(PYTHONPATH=f"{ROOT}{os.pathsep}{TESTS}")
    try:
        hosts.launch([str(PROG), str(out), *PLACEMENTS], 2, out, LAUNCH_S, env)
    except RuntimeError as exc:
        pytest.fail(str(exc))
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(4)}


@pytest.mark.parametrize(
    "names", [("hostA", "hostB"), ("trainer", "trainer")], ids=["own hostnames", "one hostname"]
)
def test_two_hosts_of_two_ranks_discover_link_classes_and_keep_traffic_local(names, tmp_path):
    with _two_hosts(names) as hosts:
        ranks = _launch(hosts, tmp_path)
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
            # one /dev/shm, two hosts by their keys: shared_memory="auto" stays off, the
            # rows cross the shaped link
            assert topo["shared_memory"] is False, r
    for placement in PLACEMENTS:  # every item put lands exactly once
        put = sorted(x for got in ranks.values() for x in got[placement]["put"])
        held = sorted(x for got in ranks.values() for x in got[placement]["held"])
        assert held == put, placement
    net = {p: sum(got[p]["sent"]["net"] for got in ranks.values()) for p in PLACEMENTS}
    # round_robin spreads every rank's puts over both hosts; bandwidth_aware keeps them on
    # their rank (colocated), so only the learners' draws from the other host cross
    assert 0 < net["bandwidth_aware"] < 0.6 * net["round_robin"], net
