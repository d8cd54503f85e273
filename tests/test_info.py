"""`python -m conduit_dist info`: world size 1 (plain python), 2 ranks (torchrun), usage."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from dist_utils import ROOT, child_env

from conduit_dist.__main__ import main
from conduit_dist.collectives.strategies import NAMES


def _run(cmd: list[str], tmp_path: Path) -> tuple[dict, str]:
    res = subprocess.run(
        cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120, check=False
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    return json.loads(lines[-1]), res.stdout


def _info_args(tmp_path: Path) -> list[str]:
    return [
        "info",
        "--json",
        "--bandwidth-cache",
        str(tmp_path / "cache"),
        "--disk-dir",
        str(tmp_path / "disk"),
    ]


def _check_tiers(report: dict, hosts: list[str]) -> None:
    tiers = report["tiers"]["hosts"]
    assert list(tiers) == hosts
    for kinds in tiers.values():
        assert {"host", "disk"} <= set(kinds)
        for t in kinds.values():
            assert t["read_gbps"] > 0 and t["write_gbps"] > 0


def test_info_world_one_plain_python(tmp_path):
    report, text = _run([sys.executable, "-m", "conduit_dist", *_info_args(tmp_path)], tmp_path)
    assert report["world_size"] == 1 and report["backend"] is None
    topo = report["topology"]
    assert topo["world"] == 1 and topo["links"] == [["self"]]
    assert list(topo["ranks_per_host"].values()) == [1]
    bw = report["bandwidth"]
    assert bw["source"] == "declared" and bw["requested"] == "declared"
    assert bw["cache_path"] is None  # world size 1 never calibrates
    assert bw["describe"].startswith("bandwidth model (declared)")
    assert set(bw["coef"]) == set(NAMES)
    _check_tiers(report, topo["hosts"])
    rows = report["strategies"]["rows"]
    assert len(rows) == 8  # 2 patterns x 4 sizes
    assert all(r["strategy"] is None for r in rows)  # a world-size-1 round moves nothing
    assert "world size 1" in text and "topology: 1 host(s)" in text
    assert not list((tmp_path / "disk").iterdir())  # the measured disk tier removed its file


def test_info_two_ranks_torchrun_calibrates_into_the_cache(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "conduit_dist",
        *_info_args(tmp_path),
        "--calibrate",
    ]
    report, text = _run(cmd, tmp_path)
    assert text.count('{"versions"') == 1  # rank 0 alone prints
    assert report["world_size"] == 2 and report["backend"] == "gloo"
    topo = report["topology"]
    assert topo["world"] == 2 and topo["links"] == [["self", "host"], ["host", "self"]]
    assert list(topo["ranks_per_host"].values()) == [2]
    bw = report["bandwidth"]
    assert bw["requested"] == "calibrate" and bw["source"] == "calibrated"
    path = Path(bw["cache_path"])
    assert bw["cache_exists"] and path.is_file() and path.parent == tmp_path / "cache"
    assert json.loads(path.read_text())["world"] == 2
    _check_tiers(report, topo["hosts"])
    rows = report["strategies"]["rows"]
    assert len(rows) == 8
    sizes = sorted({r["per_peer_bytes"] for r in rows})
    assert sizes == [4 << 10, 64 << 10, 1 << 20, 16 << 20]
    for r in rows:
        assert r["strategy"] in NAMES
        preds = r["predicted_ms_by_strategy"]
        assert set(preds) == set(NAMES) and r["predicted_ms"] == pytest.approx(preds[r["strategy"]])
        assert min(preds.values()) >= 0


def test_no_command_prints_usage_and_fails(capsys):
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: python -m conduit_dist" in err and "info" in err
    assert "a command is required" in err


def test_unknown_command_names_the_choices(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["inf"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'inf'" in err and "'info'" in err


def test_bad_record_bytes_names_the_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["info", "--record-bytes", "12"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--record-bytes" in err and "multiple of 8" in err and "12" in err
