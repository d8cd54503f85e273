"""The README's quick start, extracted from the README as a reader copies it, runs as written:
under plain ``python`` (world size 1) and under ``torchrun`` on 2 ranks."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from dist_utils import ROOT, TORCHRUN, child_env

MARKER = "<!-- quickstart -->"


def quickstart() -> str:
    """The first ```python block after the quick-start marker, exactly as the README shows it."""
    text = (ROOT / "README.md").read_text()
    assert MARKER in text, f"README.md has no {MARKER} line before its quick start"
    found = re.search(r"```python\n(.*?)```", text.split(MARKER, 1)[1], re.S)
    assert found, f"no ```python block after {MARKER} in README.md"
    return found.group(1)


def test_quickstart_is_short_and_self_contained():
    code = quickstart()
    assert len(code.splitlines()) <= 25, "the quick start should stay a quick start"
    assert "import conduit_dist as cd" in code and "cd.DataPlane(" in code


@pytest.mark.parametrize("world", [1, 2])
def test_quickstart_runs_as_written(tmp_path, world):
    script = tmp_path / "quickstart.py"
    script.write_text(quickstart())
    cmd = [sys.executable, str(script)] if world == 1 else [*TORCHRUN, str(script)]
    assert world == 1 or "--nproc_per_node=2" in TORCHRUN
    proc = subprocess.run(cmd, cwd=tmp_path, env=child_env(), capture_output=True, text=True,
                          timeout=180)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"quick start exited {proc.returncode} at world {world}:\n{out}"
    lines = re.findall(r"rank (\d+): (\d+) items in the store", proc.stdout)
    assert sorted(int(r) for r, _ in lines) == list(range(world)), out  # every rank reported
    # every rank puts 1,024 warm-up + 200 x 64 items into a 10,000-item shard: the store is full
    assert {int(n) for _, n in lines} == {10_000 * world}, out
