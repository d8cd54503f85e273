#!/usr/bin/env bash
# The one-GPU check of the CUDA paths: every step prints one line `ok ...` or stops the script
# with a non-zero exit; one JSON summary line comes last. Sized to run in under 8 minutes on one
# GPU. Run it whenever a GPU is available:
#   bash scripts/gpu_check.sh
# install  the README's line (torch==2.13.0, then the project with the [train] extra that
#          train.py needs: hydra-core, omegaconf, gymnasium, wandb, tqdm), failing loudly
# torch    refuses a CPU build of torch or a machine with no visible GPU, saying what to install
# (a) scripts/gpu_check/world1.py      world size 1: device tier, pinned staging, H2D, GPU puts
# (b) scripts/gpu_check/two_ranks.py   2 ranks on one GPU, gloo for CUDA tensors: overlap = sync,
#     tiers past overflow, donated and second-thread puts, samplers on CUDA, checkpoint SHA-256
# (c) scripts/gpu_check/nccl_world1.py NCCL at world size 1 under torchrun
# (d) scripts/gpu_check/train_run.py   train.py device=cuda: DQN (default experiment) and PPO,
#     colocated and disaggregated
# CONDUIT_GPU_CHECK_SKIP_INSTALL=1 skips the install (tests/test_gpu_check.py: the refusal on CPU).
# GPU_CHECK_KEEP_GOING=1 runs every step after a failed one too (one run finds every failure; the
# summary names the failed steps and the script exits non-zero); by default the first failure stops.
# A step is a script (a.world1, b.two_ranks, ...); its checks print `ok` lines as they pass, so a
# failed step may list some passed checks, and the checks after its failure did not run.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)

if [[ -n "${GPU_CHECK_DRY_RUN:-}" ]]; then
  echo "gpu_check: GPU_CHECK_DRY_RUN is set (a CPU rehearsal for tests): unset it" >&2
  exit 2
fi

if [[ "${CONDUIT_GPU_CHECK_SKIP_INSTALL:-0}" != 1 ]]; then
  # no build isolation: an isolated build would download setuptools (a GPU box is often offline)
  python -m pip install -q --disable-pip-version-check torch==2.13.0
  python -m pip install -q --disable-pip-version-check --no-build-isolation -e ".[train]"
  echo "ok install: torch==2.13.0 and conduit_dist[train] (editable)"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

info=$(python -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.device_count())")
read -r version cuda gpus <<<"$info"
if [[ "$cuda" == None ]]; then
  cat >&2 <<EOF
gpu_check: torch $version is a CPU build (torch.version.cuda is None): no CUDA path can run here.
Install a CUDA build of torch from its CUDA wheel index, e.g. for CUDA 12.8:
  pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128
(another CUDA version: https://download.pytorch.org/whl/cu<version>, see https://pytorch.org),
then run this script again.
EOF
  exit 2
fi
if (( gpus < 1 )); then
  echo "gpu_check: torch $version (CUDA $cuda) sees no GPU: torch.cuda.device_count() == 0" \
    "(CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset}); check the driver with nvidia-smi" >&2
  exit 3
fi
echo "ok torch: $version, CUDA $cuda, $gpus GPU(s) visible"

GPU_CHECK_OUT=$(mktemp -d)
export GPU_CHECK_OUT
failed=()
# step NAME LIMIT_S CMD...: a hang fails its step, never the budget
step() {
  local name=$1 limit=$2 rc=0
  shift 2
  timeout "$limit" "$@" || rc=$?
  (( rc == 0 )) && return 0
  echo "FAILED $name: exit code $rc$( ((rc == 124)) && echo " (timed out after ${limit} s)")" >&2
  failed+=("$name")
  [[ "${GPU_CHECK_KEEP_GOING:-0}" == 1 ]] || exit "$rc"
}

step a.world1 150 python scripts/gpu_check/world1.py
CONDUIT_CUDA_BACKEND=gloo step b.two_ranks 240 \
  torchrun --standalone --nproc_per_node=2 scripts/gpu_check/two_ranks.py
step c.nccl_world1 120 torchrun --standalone --nproc_per_node=1 scripts/gpu_check/nccl_world1.py

dqn=(total_env_steps=3000 algo.learning_starts=500)  # the default experiment: PER, 3-step
ppo=(experiment=cartpole_ppo total_env_steps=4096)
one=(mode=disaggregated "learner_ranks=[0]")
train() { step "d.train.$1" 320 python scripts/gpu_check/train_run.py "$@"; }
train dqn-1 1 "${dqn[@]}"
train dqn-2 2 "${dqn[@]}"
train dqn-2-disaggregated 2 "${dqn[@]}" "${one[@]}"
train ppo-1 1 "${ppo[@]}"
train ppo-2 2 "${ppo[@]}"
train ppo-2-disaggregated 2 "${ppo[@]}" "${one[@]}"

GPU_CHECK_FAILED="${failed[*]-}" python scripts/gpu_check/summary.py "$start"
(( ${#failed[@]} == 0 ))
