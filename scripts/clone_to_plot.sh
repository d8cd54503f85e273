#!/usr/bin/env bash
# bash scripts/clone_to_plot.sh [SRC] [DEST]
# git clone -> README's main command -> first plot, timed; a fresh venv, pip's cache off.
set -euo pipefail
export PIP_NO_CACHE_DIR=1
t0=$(date +%s.%N)
stamp() { echo "[$(python3 -c "print(f'{$(date +%s.%N) - $t0:.1f}')") s] $*"; }
SRC=${1:-$(cd "$(dirname "$0")/.." && pwd)}  # what to clone (default: this checkout)
DEST=${2:-/tmp/conduit_fresh}
rm -rf "$DEST"
git clone -q "$SRC" "$DEST" && cd "$DEST"
python -m venv .venv && . .venv/bin/activate
stamp "cloned, venv made"
pip install -q torch==2.13.0 2>&1 | grep -v WARNING || true
pip install -q -e ".[train,report]" 2>&1 | grep -v WARNING || true  # train.py; report's plots
stamp "installed"
torchrun --standalone --nproc_per_node=2 train.py > train.out 2> train.err
stamp "train.py done"
grep "done:" train.out train.err | tail -1 || true
python -m conduit_dist.report outputs
stamp "first plot written"
