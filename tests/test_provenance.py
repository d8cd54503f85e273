"""No silent fallback from a stale native build, and every benchmark line says what it ran on.

A stale build is made for real: the built extension is loaded under its own name, copied into a
module that lacks one function, and put where the package imports it from, before the package
is imported (as a ``.so`` built from an older ``pack.c`` would be).
"""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest
from dist_utils import ROOT, bench_line, child_env

from conduit_dist.bench import BENCHES

STALE = """
import glob, importlib.machinery, importlib.util, sys, types
# found, not imported: the package must first import the extension after the swap below
root = importlib.util.find_spec("conduit_dist").submodule_search_locations[0]
so = glob.glob(root + "/_native/_pack*.so")[0]
loader = importlib.machinery.ExtensionFileLoader("conduit_dist._native._pack", so)
spec = importlib.util.spec_from_file_location("conduit_dist._native._pack", so, loader=loader)
real = importlib.util.module_from_spec(spec)
loader.exec_module(real)
stale = types.ModuleType("conduit_dist._native._pack")
for name in dir(real):
    if name not in {DROP}:
        setattr(stale, name, getattr(real, name))
sys.modules["conduit_dist._native._pack"] = stale
"""


def _run(drop: list[str], body: str, **env: str) -> subprocess.CompletedProcess:
    prog = STALE.replace("{DROP}", repr(set(drop))) + body
    return subprocess.run(
        [sys.executable, "-c", prog], cwd=ROOT, env=child_env(**env), capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip


def test_a_missing_optional_native_function_is_one_warning_naming_it_on_its_rank():
    body = """
from conduit_dist.records.native import _native, native_state
import json
print(json.dumps({"loaded": _native is not None, **native_state()}))
"""
    res = _run(["seq_starts"], body, RANK="1")
    assert res.returncode == 0, res.stderr[-3000:]
    said = [ln for ln in res.stderr.splitlines() if "lacks" in ln]
    assert len(said) == 1, res.stderr
    assert "rank 1: conduit_dist._native._pack lacks seq_starts" in said[0], said
    assert "pip install -e ." in said[0] and "torch" in said[0], said
    import json

    state = json.loads(res.stdout.strip().splitlines()[-1])
    assert state["loaded"] and state["built"] and state["missing"] == ["seq_starts"], state
    # the sequence sampler still works on its Python path, exactly
    body = """
import torch, conduit_dist.sampling.sequences as seq
assert not hasattr(seq._native, "seq_starts")
print("ok")
"""
    res = _run(["seq_starts"], body)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]


def test_a_missing_required_native_function_drops_the_extension_and_says_so():
    body = """
from conduit_dist.records.native import _native, native_state
print(_native is None, native_state()["missing"][:3])
"""
    res = _run(["tree_sample", "copy_spans"], body)
    assert res.returncode == 0, res.stderr[-3000:]
    said = [ln for ln in res.stderr.splitlines() if "lacks" in ln]
    assert len(said) == 1 and "lacks tree_sample" in said[0], res.stderr
    assert "not used" in said[0], said
    assert res.stdout.startswith("True"), res.stdout


def test_info_lists_the_missing_native_functions():
    body = """
import runpy, sys
sys.argv = ["conduit_dist", "info"]
runpy.run_module("conduit_dist", run_name="__main__")
"""
    res = _run(["unpack_rows", "mean2_f32"], body)
    assert res.returncode == 0, res.stderr[-3000:]
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("native extension")]
    assert line and "missing (Python path): mean2_f32, unpack_rows" in line[0], res.stdout


MODES = {"tokens": ("token_overlap", "token_balance", "tokens_peer")}
"""Benchmarks whose options dispatch to another module that prints the line."""


def _calls_emit(module: str) -> bool:
    tree = ast.parse((ROOT / "conduit_dist" / "bench" / f"{module}.py").read_text())
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "emit"
        for n in ast.walk(tree)
    )


def test_every_benchmark_prints_its_line_through_emit():
    """``emit`` adds the provenance: a benchmark (or a mode of one) that printed its own last
    line would lack it."""
    missing = [m for name in BENCHES for m in (name, *MODES.get(name, ())) if not _calls_emit(m)]
    assert not missing, missing


@pytest.mark.timeout(120)
def test_a_benchmark_line_carries_its_provenance():
    res = subprocess.run(
        [sys.executable, "-m", "conduit_dist.bench", "sequences", "--slices", "64", "--repeats",
         "1", "--length", "8", "--no-peer", "--sizes", "1000"],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    prov = bench_line(res.stdout)["provenance"]
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    # outside a git checkout (an unpacked sdist) the commit is unknown, and says so: None
    assert prov["commit"] == (head.stdout.strip() if head.returncode == 0 else None)
    assert prov["world_size"] == 1
    assert prov["native"]["missing"] == [] or prov["native"]["built"] is False
