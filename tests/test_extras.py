"""The library installs with torch and numpy alone: in an interpreter where the extras' packages
cannot be imported, ``import conduit_dist``, a world-size-1 put/fetch loop and the loader work
and import none of them, and each entry point that needs an extra names it.

The child interpreters block the packages with a ``sys.meta_path`` finder installed by a
``sitecustomize`` module on their ``PYTHONPATH`` (site imports it at start-up), so the commands
run as users type them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_utils import ROOT, child_env

from conduit_dist.extras import require

BLOCKED = ("hydra", "omegaconf", "wandb", "gymnasium", "tqdm", "matplotlib")

SITECUSTOMIZE = f"""
import sys

BLOCKED = {BLOCKED!r}
assert not [m for m in sys.modules if m.partition(".")[0] in BLOCKED], "imported before the block"


class Block:
    '''Makes the extras' packages unimportable, as if they were not installed.'''

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
        return None


sys.meta_path.insert(0, Block())
"""

PLANE_LOOP = f"""
import json
import sys

sys.path.insert(0, {str(ROOT / "tests")!r})
import torch
from plane_helpers import assert_intact, make_batch, spec

import conduit_dist as cd

fetched = []
with cd.DataPlane(spec(), capacity_per_rank=256, seed=0) as plane:
    for it in range(6):
        plane.put(make_batch(torch.arange(16) + 16 * it))
        batch = plane.fetch(8)
        assert_intact(batch)
        fetched.append(len(batch["id"]))
    ids = iter(range(1000, 2000, 16))
    loader = cd.ExperienceLoader(
        plane, 8, collect=lambda: make_batch(torch.arange(16) + next(ids)), rounds=3
    )
    for batch in loader:
        assert_intact(batch)
        fetched.append(len(batch["id"]))
    stored = plane.stored
imported = sorted({{m.partition(".")[0] for m in sys.modules}} & set({BLOCKED!r}))
print(json.dumps({{"fetched": fetched, "stored": stored, "imported": imported}}))
"""


def _blocked(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``python *args`` from the repository root with the extras' packages blocked."""
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join((str(tmp_path), env["PYTHONPATH"]))
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_the_plane_and_the_loader_run_without_the_extras(tmp_path):
    res = _blocked(tmp_path, "-c", PLANE_LOOP)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["fetched"] == [8] * 9
    assert out["stored"] == 16 * 9
    assert out["imported"] == []  # not even tried: torch.hub's optional tqdm import fell back


def test_the_block_works(tmp_path):
    res = _blocked(tmp_path, "-c", "import gymnasium")
    assert res.returncode == 1
    assert "No module named 'gymnasium' (blocked)" in res.stderr


def _write_run(run_dir: Path) -> None:
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"env_steps": 10, "wall_s": 1.0}\n')


ENTRY_POINTS = {
    "train.py": (["train.py", "--help"], "train.py needs hydra-core (the [train] extra)"),
    "example": (["examples/loader_dqn.py"], "examples/loader_dqn.py needs gymnasium (the [train]"),
    "report": (
        ["-m", "conduit_dist.report", "RUN"],
        "python -m conduit_dist.report needs matplotlib (the [report] extra)",
    ),
}


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_an_entry_point_names_the_extra_it_needs(tmp_path, name):
    command, message = ENTRY_POINTS[name]
    run_dir = tmp_path / "run"
    _write_run(run_dir)
    res = _blocked(tmp_path, *[str(run_dir) if a == "RUN" else a for a in command])
    assert res.returncode != 0
    assert message in res.stderr, res.stderr[-3000:]
    assert 'pip install -e ".[' in res.stderr


def test_require_names_the_package_and_the_outermost_user():
    with (
        pytest.raises(ModuleNotFoundError) as info,
        require("bench", "python -m conduit_dist.bench latency"),  # the outer block
        require("train", "conduit_dist.train.config.register"),  # the inner one
    ):
        import hydra_not_installed  # noqa: F401
    assert str(info.value) == (
        "python -m conduit_dist.bench latency needs hydra_not_installed (the [bench] extra): "
        'pip install -e ".[bench]" in the conduit_dist checkout'
    )
    assert info.value.name == "hydra_not_installed"
    missing = pytest.raises(ModuleNotFoundError, match="No module named 'conduit_dist.nothing'")
    with missing, require("train", "x"):  # the package's own modules are not an extra's
        import conduit_dist.nothing  # noqa: F401
