"""The scaling bench's plumbing: its options, the jobs' command lines, the summary and failures.

No training runs: a job's "train.py" is a tiny script written to ``tmp_path``.
"""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from conduit_dist.bench import scaling

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def overrides(argv: list[str]) -> dict[str, str]:
    """``key=value`` overrides of a command line as a dict (the last one of a key wins)."""
    return dict(x.split("=", 1) for x in argv if "=" in x and not x.startswith("--"))


# ---------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--jobs", "bogus"], "argument --jobs: invalid choice: 'bogus'"),
        (["--seeds", "-1"], "argument --seeds: expected an integer >= 0, got '-1'"),
        (["--seeds", "0", "0"], "argument --seeds: expected distinct seeds, got [0, 0]"),
        (["--total-env-steps", "0"], "argument --total-env-steps: expected an integer >= 1"),
        (["--timeout-s", "0"], "argument --timeout-s: expected a finite number > 0, got '0'"),
        (["--out", "x.png"], "argument --out: expected a path ending in .json, got 'x.png'"),
        (["--experiment", "nope"], "argument --experiment: expected one of ["),
    ],
)
def test_bad_options_exit_2_naming_the_argument(argv, message, capsys, monkeypatch):
    def ran(*args, **kwargs):
        raise AssertionError(f"a job started before checking {argv}")

    monkeypatch.setattr(scaling, "run_all", ran)
    with pytest.raises(SystemExit) as exc:
        scaling.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    if argv[0] == "--jobs":
        assert "'single'" in err and "'disaggregated'" in err, err


def test_defaults_and_jobs_in_canonical_order():
    a = scaling.parse_args([])
    assert a.seeds == [0, 1, 2] and a.jobs == list(scaling.JOBS)
    assert a.experiment == "cartpole_dqn" and a.timeout_s == 900 and a.out is None
    assert scaling.parse_args(["--jobs", "disaggregated", "single", "single"]).jobs == [
        "single",
        "disaggregated",
    ]


# ---------------------------------------------------------------------------- command lines


def test_job_command_lines(tmp_path):
    a = scaling.parse_args(
        [
            "--total-env-steps",
            "3000",
            "--no-target",
            "--extra",
            "algo.lr=0.001",
            "--colocated-extra",
            "plane.schedule=sync",
            "--disaggregated-extra",
            "plane.max_lag=2",
            "algo.batch_size=64",
        ]
    )
    train = tmp_path / "train.py"
    jobs = ("single", "colocated", "disaggregated")
    cmds = {job: scaling.job_argv(job, 7, a, tmp_path, train) for job in jobs}
    assert cmds["single"][:2] == [sys.executable, str(train)]
    for job in ("colocated", "disaggregated"):
        assert cmds[job][: len(TORCHRUN) + 1] == [*TORCHRUN, str(train)], job
    common = {
        "experiment": "cartpole_dqn",
        "seed": "7",
        "total_env_steps": "3000",
        "target_return": "null",
        "logger.mode": "disabled",
        "logger.kind": "console",
        "algo.lr": "0.001",
    }
    own = {
        "single": {"plane": "simple", "env.num_envs": "16"},
        "colocated": {"env.num_envs": "8", "plane.schedule": "sync"},
        "disaggregated": {
            "mode": "disaggregated",
            "learner_ranks": "[0]",
            "env.num_envs": "16",
            "plane.max_lag": "2",
            "algo.batch_size": "64",
        },
    }
    per_job = {"plane.schedule", "plane.max_lag", "algo.batch_size", "mode", "plane"}
    for job, argv in cmds.items():
        got = overrides(argv)
        assert got["logger.summary_path"] == str(tmp_path / f"{job}_7.json"), job
        assert got["hydra.run.dir"] == str(tmp_path / f"{job}_7"), job
        assert common.items() <= got.items(), (job, got)
        assert own[job].items() <= got.items(), (job, got)
        assert not (per_job - own[job].keys()) & got.keys(), (job, got)  # others' extras absent
    # the extras come last, so they override the job's own settings
    b = scaling.parse_args(["--single-extra", "env.num_envs=4"])
    assert overrides(scaling.job_argv("single", 0, b, tmp_path, train))["env.num_envs"] == "4"
    plain = overrides(scaling.job_argv("single", 0, scaling.parse_args([]), tmp_path, train))
    assert "target_return" not in plain and "total_env_steps" not in plain
    with pytest.raises(ValueError, match="job: expected one of .* got 'triple'"):
        scaling.job_argv("triple", 0, a, tmp_path, train)
    # floor: two plain processes with a colocated rank's share, fixed length, no target
    floor = [overrides(scaling.job_argv("floor", 7, a, tmp_path, train, part)) for part in (0, 1)]
    assert [f["seed"] for f in floor] == ["7", "1007"]
    for f in floor:
        assert f["plane"] == "simple" and f["env.num_envs"] == "8"
        assert f["algo.batch_size"] == "64" and f["total_env_steps"] == "60000"
        assert f["target_return"] == "null"


# ---------------------------------------------------------------------------- summary


def result(job, seed, sps, ttt, *, iteration=2.0):
    return {
        "job": job,
        "seed": seed,
        "env_steps": 1000,
        "wall_s": 10.0,
        "process_wall_s": 12.0 + seed,
        "env_steps_per_s": sps,
        "reached_target": ttt is not None,
        "time_to_target_s": ttt,
        "breakdown_ms": {"act": 0.5, "iteration": iteration},
    }


def test_summary_is_medians_and_ratios_of_medians():
    results = [
        result("single", 0, 100.0, 50.0),
        result("single", 1, 300.0, None),  # missed the target: out of the time median
        result("single", 2, 200.0, 70.0, iteration=4.0),
        result("colocated", 0, 400.0, 30.0),
        result("colocated", 1, 500.0, 20.0),
        result("colocated", 2, 600.0, 40.0),
        result("disaggregated", 0, 150.0, None),
        result("disaggregated", 1, 250.0, None),
        result("disaggregated", 2, 50.0, None),
        result("disaggregated", 3, 180.0, None, iteration=0.0),  # no learning window timed
    ]
    s = scaling.summarize(results)
    assert s["single"]["env_steps_per_s"] == 200.0 and s["single"]["time_to_target_s"] == 60.0
    assert s["single"]["breakdown_ms"] == {"act": 0.5, "iteration": 2.0}
    assert s["single"]["process_wall_s"] == 13.0 and s["single"]["seeds"] == 3
    assert s["colocated_steps_per_s_vs_single"] == pytest.approx(500 / 200)
    assert s["colocated_time_to_target_vs_single"] == pytest.approx(30 / 60)
    assert s["disaggregated_steps_per_s_vs_single"] == pytest.approx(165 / 200)
    assert s["disaggregated"]["time_to_target_s"] is None
    assert s["disaggregated_time_to_target_vs_single"] is None
    assert s["seeds_reached"] == {"single": 2, "colocated": 3, "disaggregated": 0}
    assert s["disaggregated"]["seeds"] == 4 and s["disaggregated"]["env_steps_per_s"] == 165.0
    assert s["disaggregated"]["breakdown_ms"]["iteration"] == 2.0  # the all-zero one left out
    assert "(0/4)" in scaling.table(s) and "(2/3)" in scaling.table(s)
    json.dumps(s, allow_nan=False)  # strict JSON


def test_summary_without_single_has_no_ratios():
    s = scaling.summarize([result("colocated", 0, 400.0, 30.0)])
    assert s["colocated_steps_per_s_vs_single"] is None
    assert s["colocated_time_to_target_vs_single"] is None
    assert "single" not in s and s["seeds_reached"] == {"colocated": 1}


# ---------------------------------------------------------------------------- running a job


def fake_train(tmp_path, body: str):
    path = tmp_path / "train.py"
    path.write_text(
        "import json, os, sys, time\n"
        "args = dict(x.split('=', 1) for x in sys.argv[1:] if '=' in x)\n" + textwrap.dedent(body)
    )
    return path


def test_a_failing_job_names_job_seed_command_and_output(tmp_path, capsys, monkeypatch):
    train = fake_train(tmp_path, "print('line', 1)\nprint('boom: bad config')\nsys.exit(1)\n")
    a = scaling.parse_args(["--seeds", "3", "--jobs", "single"])
    with pytest.raises(scaling.JobError) as exc:
        scaling.run_job("single", 3, a, tmp_path, train)
    msg = str(exc.value)
    assert "job single seed 3 exited with status 1" in msg, msg
    assert f"command: {sys.executable} {train}" in msg and "seed=3" in msg, msg
    assert "boom: bad config" in msg, msg
    # through main: exit status 1, the message on stderr, no JSON line
    monkeypatch.setattr(scaling, "train_script", lambda: train)
    monkeypatch.setattr(scaling, "parse_args", lambda argv: a)
    with pytest.raises(SystemExit) as exc:
        scaling.main([])
    assert exc.value.code == 1
    out, err = capsys.readouterr()
    assert "job single seed 3 exited with status 1" in err and '"bench"' not in out


def test_a_job_without_a_summary_or_past_its_timeout_is_an_error(tmp_path):
    quiet = fake_train(tmp_path, "print('no summary')\n")
    with pytest.raises(scaling.JobError, match=r"job single seed 0 exited 0 but wrote no summary"):
        scaling.run_job("single", 0, scaling.parse_args([]), tmp_path, quiet)  # default timeout
    a = scaling.parse_args(["--timeout-s", "0.5"])  # the quiet job's start alone may take that
    slow = fake_train(tmp_path, "print('waiting', flush=True)\ntime.sleep(60)\n")
    with pytest.raises(scaling.JobError, match=r"job single seed 0 timed out after 0.5 s"):
        scaling.run_job("single", 0, a, tmp_path, slow)


def test_a_job_returns_its_summary_and_process_wall(tmp_path):
    train = fake_train(
        tmp_path,
        """
        summary = {"env_steps": 500, "env_steps_per_s": 100.0, "return_100": float("nan"),
                   "reached_target": False, "time_to_target_s": None, "seed": int(args["seed"]),
                   "threads": os.environ["OMP_NUM_THREADS"]}
        json.dump(summary, open(args["logger.summary_path"], "w"))
        """,
    )
    a = scaling.parse_args(["--seeds", "5", "--threads", "3"])
    r = scaling.run_job("single", 5, a, tmp_path, train)
    assert r["job"] == "single" and r["seed"] == 5 and r["env_steps"] == 500
    assert r["return_100"] is None  # NaN: strict JSON
    assert r["threads"] == "3"  # OMP_NUM_THREADS of the job
    assert 0 < r["process_wall_s"] < 30 and "seed=5" in r["command"]


def test_the_floor_runs_two_processes_at_once_and_keeps_the_slower_parts(tmp_path):
    train = fake_train(
        tmp_path,
        """
        slow = int(args["seed"]) >= 1000
        bd = {"act": 0.5 if slow else 0.7, "iteration": 4.0 if slow else 3.0}
        summary = {"env_steps": 600, "env_steps_per_s": 100.0, "breakdown_ms": bd}
        json.dump(summary, open(args["logger.summary_path"], "w"))
        """,
    )
    a = scaling.parse_args(["--seeds", "2"])
    r = scaling.run_job("floor", 2, a, tmp_path, train)
    assert r["breakdown_ms"] == {"act": 0.7, "iteration": 4.0}  # per part, the slower process
    assert r["env_steps_per_s"] == pytest.approx(16 * 1e3 / 4.0)
    assert r["env_steps"] == 1200 and r["time_to_target_s"] is None
