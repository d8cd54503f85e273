"""The GPU check's install step: install only what is missing, and say why either way.

Two decisions, each a pure function of what was found (so ``tests/test_gpu_check.py`` checks
them with made-up inputs), and the probes that find it:

- **torch** (:func:`torch_plan`): kept when a CUDA build whose version is within
  ``pyproject.toml``'s torch range sees a GPU (``torch.cuda.is_available()``); kept too when it
  is a CUDA build that sees no GPU (another wheel would not see one either: the check refuses
  next, naming the cause); otherwise ``pip install torch==2.13.0`` (a CPU build, none, or one
  outside the range; on a stock Linux x86 machine PyPI's wheel is a CUDA build).
- **the project and its train extra** (:func:`train_plan`): kept when its imports work
  (``hydra``, ``omegaconf``, ``gymnasium``, ``wandb``, ``tqdm``, ``conduit_dist`` and the
  native extension that ``pip install`` builds); otherwise
  ``pip install --no-build-isolation -e ".[train]"`` (no isolation: an isolated build would
  download setuptools, and a GPU machine is often offline).

    python scripts/gpu_check/install_plan.py          # print both decisions
    python scripts/gpu_check/install_plan.py --apply  # and carry them out (gpu_check.sh)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"  # the README's line
TRAIN_IMPORTS = ("hydra", "omegaconf", "gymnasium", "wandb", "tqdm", "conduit_dist")
NATIVE = "conduit_dist._native._pack"  # built by `pip install` (setup.py)
PROBE = (
    "import json, torch; "
    "print(json.dumps([torch.__version__, torch.version.cuda, torch.cuda.is_available()]))"
)


def torch_range(pyproject: str) -> str:
    """The version range of ``torch`` in ``pyproject.toml``'s text (e.g. ``>=2.4,<=2.14.1``)."""
    found = re.search(r'"torch\s*([<>=!~][^";]*)"', pyproject)
    if found is None:
        raise ValueError("pyproject.toml: no torch requirement with a version range found")
    return found.group(1).replace(" ", "")


def _release(version: str) -> tuple[int, ...]:
    """The release numbers of a version (``2.13.0+cu128``, ``2.6.0a0+ecf3bae``: ``(2, 6, 0)``);
    a pre-release or a local label counts as its release."""
    found = re.match(r"(\d+(?:\.\d+)*)", version)
    if found is None:
        raise ValueError(f"torch version: expected numbers first, got {version!r}")
    return tuple(int(p) for p in found.group(1).split("."))


def in_range(version: str, spec: str) -> bool:
    """Whether ``version``'s release satisfies every clause of ``spec`` (``>=``, ``<=``, ``>``,
    ``<``, ``==``, ``!=``; comma-separated)."""
    ops = {
        ">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b,
        "<": lambda a, b: a < b, "==": lambda a, b: a == b, "!=": lambda a, b: a != b,
    }  # fmt: skip
    have = _release(version)
    for clause in filter(None, spec.split(",")):
        op = re.match(r"(>=|<=|==|!=|>|<)", clause)
        if op is None:
            raise ValueError(f"torch range: unsupported clause {clause!r} in {spec!r}")
        want = _release(clause[op.end() :])
        width = max(len(have), len(want))
        a, b = have + (0,) * (width - len(have)), want + (0,) * (width - len(want))
        if not ops[op.group(1)](a, b):
            return False
    return True


def torch_plan(
    version: str | None, cuda: str | None, available: bool, spec: str
) -> tuple[str, str]:
    """Install torch or keep the one there.

    Args:
        version: ``torch.__version__`` (``None``: torch does not import).
        cuda: ``torch.version.cuda`` (``None``: a CPU build).
        available: ``torch.cuda.is_available()``.
        spec: ``pyproject.toml``'s torch range.

    Returns:
        ``("skip" | "install", the line to print)``.
    """
    if version is None:
        return "install", f"install {TORCH}: torch is not installed"
    if cuda is None:
        return "install", f"install {TORCH}: torch {version} is a CPU build"
    if not in_range(version, spec):
        return "install", f"install {TORCH}: torch {version} is outside pyproject's {spec}"
    label = version if "+" in version else f"{version}+cu{cuda.replace('.', '')}"
    if not available:
        return "skip", (
            f"skip install torch: {label} already installed, but it sees no GPU "
            "(torch.cuda.is_available() is False): another wheel would not see one either"
        )
    return "skip", f"skip install torch: {label} already installed (CUDA available)"


def train_plan(missing: list[str]) -> tuple[str, str]:
    """Install the project with its train extra, or keep it (``missing``: the imports that
    failed, :func:`missing_imports`)."""
    if missing:
        return "install", f'install -e ".[train]": cannot import {", ".join(missing)}'
    names = ", ".join((*TRAIN_IMPORTS, "the native extension"))
    return "skip", f'skip install -e ".[train]": {names} already import'


def probe_torch() -> tuple[str | None, str | None, bool]:
    """``(version, cuda, is_available)`` from a fresh interpreter (``None``s: no torch)."""
    res = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        return None, None, False
    version, cuda, available = json.loads(res.stdout.strip().splitlines()[-1])
    return version, cuda, bool(available)


def missing_imports() -> list[str]:
    """The train imports (and the native extension) that fail in a fresh interpreter run from
    the repository root, as the steps import them."""
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    code = (
        "import importlib, json, sys\n"
        "bad = []\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception:\n"
        "        bad.append(name)\n"
        "print(json.dumps(bad))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, *TRAIN_IMPORTS, NATIVE], cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(path)}, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    if res.returncode != 0:  # the interpreter itself failed: say everything is missing
        return [*TRAIN_IMPORTS, NATIVE]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", *args]
    print("+ " + " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def _record(entry: dict[str, str]) -> None:
    """Append the decisions to ``$GPU_CHECK_OUT/results.jsonl`` (the summary's ``install``;
    not ``common.ok``: that imports torch, which may not be installed yet)."""
    out = os.environ.get("GPU_CHECK_OUT")
    if out:
        with open(os.path.join(out, "results.jsonl"), "a") as f:
            f.write(json.dumps({"step": "install", **entry}) + "\n")


def main() -> None:
    """Print (and with ``--apply`` carry out) both decisions."""
    apply = "--apply" in sys.argv[1:]
    spec = torch_range((ROOT / "pyproject.toml").read_text())
    action, torch_line = torch_plan(*probe_torch(), spec)
    print(torch_line, flush=True)
    if apply and action == "install":
        _pip(TORCH)
        print(f"ok install: {TORCH}", flush=True)
    action, train_line = train_plan(missing_imports())
    print(train_line, flush=True)
    if apply and action == "install":
        _pip("--no-build-isolation", "-e", ".[train]")
        still = missing_imports()
        if still:
            raise SystemExit(f'install -e ".[train]" done, but {", ".join(still)} still fail')
        print("ok install: conduit_dist[train] (editable)", flush=True)
    if apply:
        _record({"torch": torch_line, "train": train_line})


if __name__ == "__main__":
    main()
