#!/usr/bin/env bash
# The test command (README and .ci/run): install torch's CPU build first, then the project with its
# dev extra, then lint, format check and the test suite. Safe to run on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --disable-pip-version-check "torch==2.13.0"
python -m pip install -q --disable-pip-version-check -e ".[dev]"
ruff check .
ruff format --check .
export WANDB_MODE=disabled OMP_NUM_THREADS=1
python -m pytest -q tests "$@"
