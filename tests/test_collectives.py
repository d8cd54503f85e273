"""Exchange heartbeats and phases on real gloo ranks; benchmark argument checks."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from dist_utils import ROOT, TORCHRUN, child_env, run_ranks

from conduit_dist.collectives.exchange import Heartbeats

TIMEOUT_S = 3.0


class _Store:
    """A store whose ``check`` raises ``exc`` (a dead rendezvous store, or a bug)."""

    def __init__(self, exc: BaseException) -> None:
        self.exc, self.timeout = exc, timedelta(seconds=30)

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout = timeout

    def set(self, key: str, value: str) -> None:
        raise self.exc

    def check(self, keys: list[str]) -> bool:
        raise self.exc


def test_heartbeats_name_the_ranks_behind_and_leave_the_store_timeout_as_it_was():
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=7))
    beats = [Heartbeats(store, "p/", rank, 3) for rank in range(3)]
    beats[0].mark("round", 4)
    beats[1].mark("round", 3)  # rank 2 never marks
    assert beats[0].behind("round", 4) == (1, 2)
    assert beats[0].behind("round", 3) == (2,)
    assert beats[0].behind("phase", 1) == (0, 1, 2)  # channels are separate
    assert store.timeout == timedelta(seconds=7)


def test_a_dead_store_leaves_ranks_unnamed_with_one_warning_and_other_errors_propagate(caplog):
    caplog.set_level(logging.WARNING, logger="conduit_dist")
    dead = _Store(dist.DistNetworkError("Broken pipe"))
    beats = Heartbeats(dead, "p/", 1, 2)
    beats.mark("round", 0)  # the collective will fail and say so; the mark is only for naming
    assert beats.behind("round", 1) == ()
    assert beats.behind("round", 2) == ()
    warned = [r for r in caplog.records if "cannot name" in r.getMessage()]
    assert len(warned) == 1 and "DistNetworkError: Broken pipe" in warned[0].getMessage()
    assert dead.timeout == timedelta(seconds=30)  # restored after the failed query too
    with pytest.raises(ValueError, match="corrupt"):  # not a store failure: a bug, not hidden
        Heartbeats(_Store(ValueError("corrupt mark")), "p/", 0, 2).behind("round", 1)


def test_no_store_api_is_said_once_on_rank_zero(caplog, monkeypatch):
    from conduit_dist.collectives import exchange

    caplog.set_level(logging.WARNING, logger="conduit_dist")
    monkeypatch.delattr(dist.distributed_c10d, "_get_default_store")
    store, why = exchange._default_store()
    assert store is None and "_get_default_store is missing" in why
    beats = Heartbeats(store, "p/", 0, 2, why)
    Heartbeats(store, "p/", 1, 2, why)  # other ranks stay quiet: the same line everywhere
    assert beats.behind("round", 3) == ()
    assert [r.getMessage() for r in caplog.records if "cannot name" in r.getMessage()] == [
        f"rank 0: failures cannot name the ranks that never arrived: {why}"
    ]


def _laggards(rank, world):
    from conduit_dist.collectives.exchange import Exchange

    ex = Exchange(TIMEOUT_S)
    store = dist.distributed_c10d._get_default_store()
    before = store.timeout
    ex.heartbeat(3 if rank == 0 else 2)
    dist.barrier()  # every mark written
    late = ex.laggards(3), ex.laggards(2)
    ex.close()
    return late, before, store.timeout


def test_exchange_laggards_restore_the_default_store_timeout():
    res = run_ranks(_laggards, 2, collective_timeout_s=TIMEOUT_S * 10)
    for (late3, late2), before, after in res.values():
        assert late3 == (1,) and late2 == ()
        assert before == timedelta(seconds=TIMEOUT_S * 10)
        assert after == before  # the query's 2 s timeout did not stay on the shared store


def _phases(rank, world):
    """Rank 1 joins every group but never enters a phase; rank 0 tries each one in turn."""
    from conduit_dist.collectives.exchange import Exchange
    from conduit_dist.collectives.model import BandwidthModel, build, calibrate
    from conduit_dist.collectives.topology import Topology, discover
    from conduit_dist.train.metrics import aggregate

    exchanges = [Exchange(TIMEOUT_S, name=str(i)) for i in range(3)]
    topo = Topology.single_host(world)
    declared = BandwidthModel.declared(1e-4, {"self": 8.0, "host": 1.5, "net": 0.1})
    phases = {
        "discover": lambda: discover(exchanges[0]),
        "calibrate": lambda: calibrate(exchanges[1], topo, sizes=(1024,), repeats=1),
        "build": lambda: build(exchanges[2], topo, True, None, declared),
        "metrics": lambda: aggregate({"loss": 1.0}, timeout_s=TIMEOUT_S),
    }
    if rank == 1:
        time.sleep(len(phases) * TIMEOUT_S + 3)  # alive, stalled: never arrives
        return None
    out = {}
    for name, call in phases.items():
        t0 = time.monotonic()
        try:
            call()
            out[name] = "no error"
        except Exception as exc:
            phase, ranks = getattr(exc, "phase", None), list(getattr(exc, "ranks", ()))
            out[name] = (type(exc).__name__, phase, ranks, str(exc), time.monotonic() - t0)
    return out


def test_start_up_phases_and_metrics_fail_in_time_naming_the_phase_and_the_missing_rank():
    res = run_ranks(_phases, 2, collective_timeout_s=TIMEOUT_S)[0]
    expected = {
        "discover": "start-up: discover hosts",
        "calibrate": "start-up: calibrate",
        "build": "start-up: agree on the bandwidth model",
        "metrics": "metrics.aggregate",
    }
    for name, phase in expected.items():
        assert res[name] != "no error", name
        kind, got_phase, ranks, msg, waited = res[name]
        assert kind == "PhaseError", msg
        assert got_phase == phase and msg.startswith(f"{phase}: "), msg
        assert ranks == [1], msg
        assert "failed on rank 0" in msg and f"timeout {TIMEOUT_S:g}s" in msg, msg
        assert "ranks [1] never entered this phase" in msg, msg
        assert waited < TIMEOUT_S + 2.5, (name, waited)


# ---------------------------------------------------------------------------- benchmark arguments


def test_out_path_and_number_name_what_they_expected_and_got(tmp_path, capsys):
    import argparse

    from conduit_dist.bench.common import check_out_path, number, out_path

    assert check_out_path(str(tmp_path / "new" / "dir" / "plot.PNG"), (".png",))  # not created
    assert not (tmp_path / "new").exists()
    (tmp_path / "a_file").write_text("")
    with pytest.raises(argparse.ArgumentTypeError, match=r"under a writable directory.*a_file"):
        check_out_path(str(tmp_path / "a_file" / "plot.png"), (".png",))
    p = argparse.ArgumentParser(prog="bench")
    p.add_argument("--out", type=out_path(".png", ".svg"))
    p.add_argument("--repeats", type=number(int, 1))
    p.add_argument("--gib", type=number(float, 0))
    p.add_argument("--ratio", type=number(float, 0, strict=True))
    assert p.parse_args(["--repeats", "3", "--gib", "0", "--ratio", "0.5"]).ratio == 0.5
    cases = [
        (
            ["--out", "x.json"],
            "argument --out: expected a path ending in .png or .svg, got 'x.json'",
        ),
        (["--repeats", "0"], "argument --repeats: expected an integer >= 1, got '0'"),
        (["--repeats", "2.5"], "argument --repeats: expected an integer >= 1, got '2.5'"),
        (["--gib", "-1"], "argument --gib: expected a finite number >= 0, got '-1'"),
        (["--gib", "nan"], "argument --gib: expected a finite number >= 0, got 'nan'"),
        (["--gib", "inf"], "argument --gib: expected a finite number >= 0, got 'inf'"),
        (["--ratio", "0"], "argument --ratio: expected a finite number > 0, got '0'"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exc:
            p.parse_args(argv)
        assert exc.value.code == 2
        assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("bench", "argv", "message"),
    [
        ("ingest", ["--repeats", "0"], "argument --repeats: expected an integer >= 1, got '0'"),
        ("ingest", ["--sizes-kib", "64", "-1"], "argument --sizes-kib: expected an integer >= 1"),
        ("strategies", ["--sizes-kib", "0"], "argument --sizes-kib: expected an integer >= 1"),
        ("strategies", ["--repeats", "x"], "argument --repeats: expected an integer >= 1, got 'x'"),
        ("placement", ["--rounds", "0"], "argument --rounds: expected an integer >= 1, got '0'"),
        ("placement", ["--demote-items", "3"], "argument --demote-items: expected an integer >= 4"),
        ("placement", ["--gib", "1e-9"], "argument --gib: expected 0 (skip) or at least"),
    ],
)
def test_benchmarks_reject_bad_arguments_before_measuring(
    bench, argv, message, capsys, monkeypatch
):
    import importlib

    import conduit_dist as cd

    def measured(*args, **kwargs):
        raise AssertionError(f"bench {bench} started before checking {argv}")

    monkeypatch.setattr(cd, "init_distributed", measured)
    with pytest.raises(SystemExit) as exc:
        importlib.import_module(f"conduit_dist.bench.{bench}").main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_entry_point_names_the_benchmarks(capsys):
    from conduit_dist.bench.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["nope", "--repeats", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument NAME: invalid choice: 'nope'" in err and "'strategies'" in err


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_destroy_distributed_frees_the_default_group_after_an_optimizer_is_built(tmp_path):
    # Building an optimizer imports torch._dynamo, which imports torch.distributed.nn,
    # whose defaults would hold the default group: its gloo threads then outlive
    # destroy_process_group and can abort the process at exit (CI: an example exited -6).
    prog = ROOT / "tests" / "teardown_prog.py"
    res = subprocess.run(
        [*TORCHRUN, str(prog)],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    left = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [x["gloo_workers"] for x in left] == [0, 0], left
