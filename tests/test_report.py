"""The run's local record (metrics.jsonl, run.json), the report's PNGs, the console display and
the rounds' bytes per destination (``RoundStats.sent``), on real runs and real gloo ranks."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import ROOT, child_env, run_ranks
from omegaconf import OmegaConf
from plane_helpers import make_batch, spec

import conduit_dist as cd
from conduit_dist.errors import ConfigError
from conduit_dist.tools.report import MetricsFile, newest_run, read_run, report
from conduit_dist.train.config import TrainConfig
from conduit_dist.train.progress import Bar, Lines, choose

PNG = b"\x89PNG\r\n\x1a\n"


def _train(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "train.py"), "experiment=smoke", *overrides]
    cmd.append(f"hydra.run.dir={run_dir}")
    return subprocess.run(
        cmd, cwd=run_dir.parent, env=child_env(), capture_output=True, text=True, timeout=120
    )


def _report(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "conduit_dist.report", *args]
    return subprocess.run(
        cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=60
    )


def test_a_real_run_writes_metrics_and_the_report_draws_them(tmp_path):
    run = tmp_path / "run"
    res = _train(run, "logger=none", "total_env_steps=2000", "logger.log_every=25")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 10  # 250 iterations of 8 env steps, one row per 25
    steps = [r["env_steps"] for r in rows]
    assert steps == sorted(set(steps)) and steps[-1] == 2000
    for key in (
        "wall_s",
        "rl/episode_return_100",
        "path/exposed_ms_mean",
        "path/hidden_ms_mean",
        "path/bytes_self",
        "path/bytes_host",
        "path/bytes_net",
        "store/tier0_host_bytes",
        "path/exposed_ms_hist_p50",
        "path/policy_age_max",
    ):
        assert all(key in r for r in rows), key
    assert rows[-1]["path/bytes_self"] > 0 and rows[-1]["path/bytes_host"] == 0  # one rank
    info = json.loads((run / "run.json").read_text())
    assert info["world_size"] == 1 and info["config"]["total_env_steps"] == 2000

    out = tmp_path / "plots"
    res = _report(str(run), "--out", str(out))
    assert res.returncode == 0, res.stderr
    names = ("return.png", "path_time.png", "link_bytes.png", "store_tiers.png")
    for name in names:
        data = (out / name).read_bytes()
        assert data[:8] == PNG and len(data) > 10_000, name
        assert str(out / name) in res.stdout
    assert "2,000 env steps" in res.stdout


def test_wandb_disabled_run_still_writes_metrics(tmp_path):
    run = tmp_path / "run"
    res = _train(run, "logger=wandb", "logger.mode=disabled", "total_env_steps=800")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows, info = read_run(str(run))
    assert [r["env_steps"] for r in rows] == [400, 800]
    assert info["config"]["logger"]["kind"] == "wandb"


def test_report_skips_plots_the_run_did_not_log_and_names_a_missing_file(tmp_path):
    f = MetricsFile(str(tmp_path), {"target_return": 100.0}, world_size=2)  # PPO-like rows
    for step in (512, 1024, 1536):
        row = {"rl/episode_return_100": step / 10, "path/exposed_ms_mean": 1.0}
        f.log({**row, "path/hidden_ms_mean": 3.0}, step, {"path/policy_age_hist": [0, 0, 1]})
    f.close()
    written, skipped = report(str(tmp_path))
    assert [os.path.basename(p) for p in written] == ["return.png", "path_time.png"]
    assert len(skipped) == 6 and all(s.startswith("skipped ") for s in skipped)
    assert any("path/bytes_{self,host,net}" in s for s in skipped)
    assert any("reward.png: the run logged no rl/reward" in s for s in skipped)
    rows, _ = read_run(str(tmp_path))
    assert rows[0]["path/policy_age_hist_max"] == 1.0

    empty = tmp_path / "empty"
    empty.mkdir()
    res = _report(str(empty))
    assert res.returncode == 2
    assert str(empty / "metrics.jsonl") in res.stderr


def test_read_run_drops_the_rows_a_restart_lost(tmp_path):
    for steps in ((100, 200, 300), (200, 300, 400)):  # resumed from a checkpoint at 100
        f = MetricsFile(str(tmp_path), {}, world_size=1)
        for s in steps:
            f.log({"x": float(s)}, s)
        f.close()
    rows, _ = read_run(str(tmp_path))
    assert [r["env_steps"] for r in rows] == [100, 200, 300, 400]


class _Terminal(io.StringIO):
    """A text stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_progress_picks_lines_off_a_terminal_and_bar_when_forced(caplog):
    assert choose("auto", io.StringIO()) == "lines"
    assert choose("auto", _Terminal()) == "bar"
    assert choose("bar", io.StringIO()) == "bar"
    assert choose("lines", _Terminal()) == "lines"
    with pytest.raises(ConfigError, match=r"logger\.progress: expected one of .*got 'fancy'"):
        choose("fancy")
    cfg = OmegaConf.structured(TrainConfig)
    cfg.logger.progress = "fancy"
    with pytest.raises(ConfigError, match=r"logger\.progress"):
        OmegaConf.to_object(cfg)  # at composition, on every rank

    stream = _Terminal()
    bar = Bar(1000, stream)
    bar.update({"rl/episode_return_100": 42.0, "path/iter_exposed_ms": 1.5}, 500)
    bar.close()
    assert "500/1.00k" in stream.getvalue() and "ret100=42.0" in stream.getvalue()
    with caplog.at_level(logging.INFO, logger="conduit_dist"):
        Lines(1000).update({"rl/episode_return_100": 42.0}, 500)
    assert "50% steps=500 ret100=42.0" in caplog.text


def _sent(rank: int, world: int, run_dir: str):
    from conduit_dist.train.metrics import make_logger

    out = {}
    for placement in ("round_robin", "local"):  # three exchanges a round; one exchange
        plane = cd.DataPlane(spec(), 400, seed=3, placement=placement, schedule="sync")
        rb, rounds = plane.spec.with_version().record_bytes, []  # records carry _version
        for it in range(3):
            plane.put(make_batch(rank * 1000 + it * 100 + torch.arange(40)))
            origin = (plane.fetch(16)["id"] // 1000).tolist()
            st = plane.stats
            rounds.append((st.sent.tolist(), st.items_in, [origin.count(r) for r in range(world)]))
        plane.close()
        out[placement] = rounds
    logger = make_logger("none", "disabled", "p", 10, {"logger": {"progress": "lines"},
                         "target_return": None}, run_dir)  # fmt: skip
    logger.log({"x": 1.0}, 1)
    logger.close()
    return rb, out, type(logger).__name__


def test_round_stats_count_bytes_sent_to_each_rank(tmp_path):
    got = run_ranks(_sent, 2, str(tmp_path))
    rb = got[0][0]
    spread = {r: got[r][1]["round_robin"] for r in range(2)}
    for i in range(3):
        for dst in range(2):  # what a rank received: its ingested items and its batch's rows
            received = sum(spread[src][i][0][dst] for src in range(2))
            assert received == (spread[dst][i][1] + 16) * rb
    local = {r: got[r][1]["local"] for r in range(2)}
    for i in range(3):
        for me in range(2):
            sent, _, origin = local[me][i]
            assert sent[me] == (40 + origin[me]) * rb  # own items, own shard's rows: copies
            peer = 1 - me
            assert sent[peer] > local[peer][i][2][me] * rb  # rows, headers, candidates
    assert [got[r][2] for r in range(2)] == ["RunLogger", "NullLogger"]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1  # rank 0 only


def test_a_directory_of_runs_means_its_newest_run(tmp_path):
    for i, name in enumerate(["run-a", "run-b", "run-c"]):
        (tmp_path / name).mkdir()
        if name != "run-c":  # run-c has no metrics: not a run the report can draw
            f = tmp_path / name / "metrics.jsonl"
            f.write_text("{}\n")
            os.utime(f, (1_000_000 + i, 1_000_000 + i))
    assert newest_run(str(tmp_path)) == str(tmp_path / "run-b")
    assert newest_run(str(tmp_path / "run-a")) == str(tmp_path / "run-a")
    assert newest_run(str(tmp_path / "run-c")) == str(tmp_path / "run-c")  # named as missing
