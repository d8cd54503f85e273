"""The plane's process group: backend choice, host identity, NCCL-style waits, on CPU.

What runs only with CUDA (the NCCL warm-up, ``device_id``) is kept to a few lines in
``Exchange``; everything it decides on is tested here: the backend rule, the CUDA backend's
sources, which planes use CUDA, the watchdog's timeout, the host key, and the polled wait
(run on real gloo works of real groups).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from datetime import timedelta

import pytest
import torch
from dist_utils import ROOT, TORCHRUN, child_env, run_ranks

from conduit_dist.collectives.dist import (
    CUDA_BACKEND_ENV,
    CUDA_BACKENDS,
    backends_of,
    cuda_backend_of,
    plane_backend,
    resolve_cuda_backend,
    uses_cuda,
    watchdog_timeout,
)
from conduit_dist.collectives.heartbeats import poll_until
from conduit_dist.collectives.strategies import GLOO_CUDA, NAMES, usable
from conduit_dist.collectives.topology import host_key
from conduit_dist.errors import ConfigError

TIMEOUT_S = 2.0


# ------------------------------------------------------------------------------- pure rules


def test_plane_backend_is_gloo_on_cpu_and_names_the_cuda_backend_otherwise():
    assert plane_backend(False) == "gloo"
    assert plane_backend(False, "gloo") == "gloo"
    assert plane_backend(True) == "cpu:gloo,cuda:nccl"
    assert plane_backend(True, "gloo") == "cpu:gloo,cuda:gloo"  # ranks sharing one GPU
    assert backends_of("cpu:gloo,cuda:nccl") == {"gloo", "nccl"}
    assert backends_of("gloo") == {"gloo"}
    with pytest.raises(
        ConfigError, match=r"cuda_backend: expected one of \['nccl', 'gloo'\], got 'mpi'"
    ):
        plane_backend(True, "mpi")


def test_gpu_rows_over_gloo_move_by_the_fused_all_to_all_only():
    # gloo's send/recv and gather take host pointers only (a CUDA tensor's fail with EFAULT,
    # seen on an H200): point-to-point and gather are kept for host rows and NCCL
    assert cuda_backend_of("cpu:gloo,cuda:nccl") == "nccl"
    assert cuda_backend_of("cpu:gloo,cuda:gloo") == "gloo"
    assert cuda_backend_of("gloo") == "gloo"
    assert usable(True, "gloo") == GLOO_CUDA == ("all_to_all",)
    assert usable(False, "gloo") == usable(True, "nccl") == usable(True, "") == NAMES
    assert {"p2p", "gather"} <= set(NAMES)
    from conduit_dist.collectives.transport import check_cuda_strategy

    for ok in (("auto", "gloo"), ("all_to_all", "gloo"), ("p2p", "nccl"), ("gather", "nccl")):
        check_cuda_strategy(*ok)
    with pytest.raises(ConfigError, match=r"strategy: 'p2p' cannot move CUDA rows over gloo"):
        check_cuda_strategy("p2p", "gloo")


def test_cuda_backend_comes_from_the_argument_then_the_environment_then_nccl():
    assert list(CUDA_BACKENDS) == ["nccl", "gloo"]
    assert resolve_cuda_backend(None, {}) == "nccl"
    assert resolve_cuda_backend(None, {CUDA_BACKEND_ENV: "gloo"}) == "gloo"
    assert resolve_cuda_backend("nccl", {CUDA_BACKEND_ENV: "gloo"}) == "nccl"  # code wins
    with pytest.raises(ConfigError) as exc:
        resolve_cuda_backend(None, {CUDA_BACKEND_ENV: "NCCL"})
    assert str(exc.value) == (
        "environment variable CONDUIT_CUDA_BACKEND: expected one of ['nccl', 'gloo'], got 'NCCL'"
    )
    with pytest.raises(ConfigError, match=r"^cuda_backend: expected one of .*got 'ucc'"):
        resolve_cuda_backend("ucc", {})


def test_a_plane_uses_cuda_with_a_cuda_device_only():
    """A device tier on a CPU plane keeps rows on the host: no CUDA tensor reaches the group."""
    assert not uses_cuda("cpu")
    assert not uses_cuda(torch.device("cpu"))
    assert uses_cuda("cuda")
    assert uses_cuda(torch.device("cuda", 1))


def test_nccl_watchdog_waits_well_past_the_planes_timeout():
    for plane_s in (0.5, 60.0, 600.0):
        plane = timedelta(seconds=plane_s)
        assert watchdog_timeout(plane) >= 2 * plane + timedelta(seconds=30)


def test_host_key_prefers_the_launchers_node_index_over_the_hostname():
    # containers on two nodes with one hostname: the node index tells them apart
    a, b = host_key({"GROUP_RANK": "0"}, "trainer"), host_key({"GROUP_RANK": "1"}, "trainer")
    assert (a, b) == ("node0@trainer", "node1@trainer")
    assert host_key({"SLURM_NODEID": "3"}, "gpu-7") == "slurm-node3@gpu-7"
    both = {"GROUP_RANK": "1", "SLURM_NODEID": "0"}  # srun launching torchrun: torchrun's wins
    assert host_key(both, "x") == "node1@x"
    assert host_key({}, "gpu-7") == "gpu-7"  # plain python, another launcher
    assert host_key({"LOCAL_RANK": "3", "RANK": "9"}, "h") == "h"  # ranks are not nodes
    with pytest.raises(ConfigError) as exc:
        host_key({"GROUP_RANK": "node-1"}, "h")
    assert str(exc.value) == (
        "environment variable GROUP_RANK: expected the launcher's node index (an integer "
        ">= 0), got 'node-1'"
    )
    with pytest.raises(ConfigError, match="SLURM_NODEID.*got '-1'"):
        host_key({"SLURM_NODEID": "-1"}, "h")


def test_poll_until_returns_when_done_and_gives_up_at_the_deadline():
    done = threading.Event()
    timer = threading.Timer(0.05, done.set)
    timer.start()
    t0 = time.monotonic()
    assert poll_until(done.is_set, t0 + 5.0)
    assert time.monotonic() - t0 < 0.5  # seen within the 1 ms cap, not at the deadline
    never = threading.Event()
    t0 = time.monotonic()
    assert not poll_until(never.is_set, t0 + 0.2)
    assert 0.2 <= time.monotonic() - t0 < 0.4


# ------------------------------------------------------------------------------- real ranks


def test_the_planes_group_is_gloo_even_under_a_default_group_without_a_cpu_backend(tmp_path):
    # a user's own init_process_group under torchrun, with no CPU backend ("cuda:gloo" here,
    # "nccl" on a GPU machine): the plane's group used to copy it
    prog = ROOT / "tests" / "cuda_only_default_prog.py"
    res = subprocess.run(
        [*TORCHRUN, str(prog)],
        cwd=tmp_path,
        env=child_env(PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    for r in range(2):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert "No backend type associated with device type cpu" in got["default_cpu"]
        assert got["backend"] == "gloo"  # not "cuda:gloo" copied from the default group
        assert got["shared_backend"] == "cpu:gloo,cuda:gloo" and got["flag"] == 2
        assert got["hosts"] == 1  # host discovery (a CPU collective) ran on the plane's group


def _init_records_the_cuda_backend() -> str:
    """In a fresh process (no group left over by an earlier test in this one)."""
    import os

    import torch.distributed as dist

    from conduit_dist.collectives.dist import (
        chosen_cuda_backend,
        destroy_distributed,
        init_distributed,
    )

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", CUDA_BACKEND_ENV):
        os.environ.pop(k, None)
    assert not dist.is_initialized() and chosen_cuda_backend() == "nccl"
    os.environ[CUDA_BACKEND_ENV] = "nccl2"
    with pytest.raises(ConfigError) as exc:
        init_distributed()
    assert str(exc.value) == (
        "environment variable CONDUIT_CUDA_BACKEND: expected one of ['nccl', 'gloo'], got 'nccl2'"
    )
    assert not dist.is_initialized()  # refused before any group exists
    del os.environ[CUDA_BACKEND_ENV]
    try:
        init_distributed(cuda_backend="gloo")
        assert dist.get_backend() == "gloo"  # a CPU device: gloo whatever the CUDA backend
        assert chosen_cuda_backend() == "gloo"
        init_distributed(cuda_backend="nccl")  # a group exists: only the choice is recorded
        assert chosen_cuda_backend() == "nccl"
        init_distributed(cuda_backend="gloo")
    finally:
        destroy_distributed()
    assert chosen_cuda_backend() == "nccl"  # forgotten with the group
    return "ok"


def test_init_distributed_records_the_cuda_backend_and_refuses_a_bad_variable():
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.apply(_init_records_the_cuda_backend) == "ok"


def _node_ranks(rank: int, world: int):
    """Every rank on this machine, two "nodes" by torchrun's node rank: ranks 0 and 1, rank 2."""
    import socket

    from conduit_dist.collectives.exchange import Exchange
    from conduit_dist.collectives.topology import discover

    os.environ["GROUP_RANK"] = str(rank // 2)
    ex = Exchange(TIMEOUT_S * 5, name="nodes")
    topo = discover(ex)
    ex.close()
    return list(topo.hosts), list(topo.host_of), topo.link_matrix().tolist(), socket.gethostname()


def test_discovery_groups_ranks_by_node_rank_on_one_machine():
    got = run_ranks(_node_ranks, 3)
    name = got[0][3]
    for hosts, host_of, links, _ in got.values():
        assert hosts == [f"node0@{name}"] * 2 + [f"node1@{name}"]
        assert host_of == [0, 0, 1]
        # self 0, host 1, net 2: what the bandwidth model prices
        assert links == [[0, 1, 2], [1, 0, 2], [2, 2, 0]]


def _polled_wait(rank: int, world: int):
    """The wait of a group with NCCL, run on real gloo works: rank 1 comes late to round 5."""
    import torch.distributed as dist

    from conduit_dist.collectives.exchange import Exchange
    from conduit_dist.errors import RoundError

    ex = Exchange(TIMEOUT_S, name="poll")
    ex._poll = True  # the NCCL branch's wait (gloo works complete on the host the same way;
    # cuda=True below marks each work as the group's NCCL one)
    ex._lazy[True] = False  # as on cpu:gloo,cuda:nccl: an NCCL wait marks before it polls
    ok = torch.ones(1)
    ex.arrive(4)
    ex.run(lambda: dist.all_reduce(ok, group=ex.group, async_op=True), "all_reduce(ok)", 4, True)
    late = torch.ones(1)
    out = {"ok": int(ok.item())}
    if rank == 1:
        time.sleep(TIMEOUT_S + 1.5)  # alive, but past rank 0's deadline
    ex.arrive(5)
    t0 = time.monotonic()
    try:
        ex.run(
            lambda: dist.all_reduce(late, group=ex.group, async_op=True), "all_reduce(x)", 5, True
        )
        out["late"] = "no error"
    except RoundError as exc:
        out["late"] = (str(exc), exc.round, list(exc.ranks), time.monotonic() - t0)
    dist.barrier()  # (gloo's own timeout ended rank 0's work: rank 1's fails at once)
    ex.close()
    return out


def test_polled_wait_raises_the_planes_round_error_naming_rank_and_round_in_time():
    got = run_ranks(_polled_wait, 2, collective_timeout_s=TIMEOUT_S * 10)
    assert got[0]["ok"] == got[1]["ok"] == 2  # a completed work passes
    msg, rnd, ranks, waited = got[0]["late"]
    assert rnd == 5 and ranks == [1]
    assert msg.startswith("round 5: all_reduce(x) failed on rank 0 after "), msg
    assert f"(timeout {TIMEOUT_S:g}s); ranks [1] never reached round 5" in msg, msg
    assert TIMEOUT_S - 0.05 <= waited < TIMEOUT_S + 1.0
