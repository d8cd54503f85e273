"""Benchmark argument checks (bench/common.py helpers, each bench's parser, the entry point)."""

from __future__ import annotations

import pytest

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
