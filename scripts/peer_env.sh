#!/usr/bin/env bash
# The peers' own interpreter for benchmarks that compare against TorchRL's PrioritizedSampler
# (torchrl 0.14.1 loads its C++ extension with torch 2.14.1 only, which cannot share the
# project's torch 2.13.0 CPU build): .venv-peer, used by `python -m conduit_dist.bench per`.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m venv .venv-peer
.venv-peer/bin/pip install -q torch==2.14.1 torchrl==0.14.1 tensordict==0.14.3 numpy
.venv-peer/bin/python -c "from torchrl.data import PrioritizedSampler; PrioritizedSampler(8, 0.6, 0.4)"
echo "peer environment ready: .venv-peer/bin/python"
