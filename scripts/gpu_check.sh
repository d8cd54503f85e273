#!/usr/bin/env bash
# The GPU check of the CUDA paths, one prepared run for one H100 (docs/gpu.md): every step prints
# `ok ...` lines as its checks pass, or stops the script with a non-zero exit; one JSON summary
# line comes last (device, NVIDIA driver, torch, CUDA, commit, each step's numbers).
#   bash scripts/gpu_check.sh
#   GPU_CHECK_COMMIT=$(git rev-parse HEAD) bash scripts/gpu_check.sh  # a copied tree without .git
# Steps and their time limits (s); the sum, 595, stays under the 10 minutes it is sized to:
#   install           40  install_plan.py --apply: torch kept if a CUDA build in pyproject's range
#                         sees a GPU, else `pip install torch==2.13.0`; the [train] extra kept if
#                         its imports work, else `pip install --no-build-isolation -e ".[train]"`
#   torch              -  refuses a CPU build (exit 2) or no visible GPU (exit 3), saying why
#   a.world1          30  world size 1: device tier, pinned staging, GPU puts, host reads,
#                         side-stream rounds, pooled buffers, allocator requests, memory 50 vs 300
#   r.rows            35  7 samplers: cuda plane == cpu plane, rows and first tier on the GPU,
#                         host syncs per iteration within the budget
#   s.1.sanitizer     40  TORCH_CUDA_SANITIZER=1, 1 rank: overlap, landing, tiers past overflow
#   s.2.sanitizer     50    with donated and second-thread puts, checkpoint while overwritten;
#                         2 ranks sharing the GPU (gloo); no "CSAN detected a possible data race"
#   b.two_ranks       45  2 ranks sharing the GPU (gloo): overlap vs sync, tiers, samplers, queues,
#                         a checkpoint restored equal
#   o.overlap         45  2 ranks, GPU-bound backward: overlap's exposed wait <= 25% of sync's,
#                         the round >= 70% hidden; the overlapped plane's memory 50 vs 300
#   d.train.*        160  train.py device=cuda: DQN 1 and 2 ranks (host syncs per iteration, rows
#                         on the GPU), PPO 1 rank, GRPO 1 and 2 ranks
#   k.kill_resume     60  scripts/kill_resume.py with device=cuda: a rank killed, resumed, finished
#   t.tokens1/2    25+30  the token plane at world size 1 (NCCL) and on 2 ranks sharing the GPU:
#                         sequences byte-identical and whole (GPU and host puts), micro-batches
#                         and arenas on the GPU, the next batch's round launched at the backward,
#                         puts while it runs; host syncs per fetch (0) and per put (0 / 2, counted)
#   c.nccl_world1     35  NCCL at world size 1 (groups, a plane with DDP), the Exchange's wait on
#                         the device and its close with work queued (last: see docs/gpu.md)
#   g.two_gpus       120  only where torch.cuda.device_count() >= 2 (not in the sum): NCCL between
#                         ranks, device mapping, exactness against the rehearsal, train.py on NCCL
# The one-GPU steps run on the first visible GPU (CUDA_VISIBLE_DEVICES pinned to it).
# CONDUIT_GPU_CHECK_SKIP_INSTALL=1 skips the install (tests/test_gpu_check.py: the refusal on CPU).
# GPU_CHECK_KEEP_GOING=1 runs every step after a failed one too (one run finds every failure; the
# summary names the failed steps and the script exits non-zero); by default the first failure stops.
# A step is a script; its checks print `ok` lines as they pass, so a failed step may list some
# passed checks, and the checks after its failure did not run.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)

if [[ -n "${GPU_CHECK_DRY_RUN:-}" ]]; then
  echo "gpu_check: GPU_CHECK_DRY_RUN is set (a CPU rehearsal for tests): unset it" >&2
  exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
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
# skipped NAME REASON: a step that cannot run here, named in the summary's "skipped"
skipped() {
  echo "skip $1: $2"
  python -c 'import json, sys; print(json.dumps({"step": sys.argv[1], "skipped": sys.argv[2]}))' \
    "$1" "$2" >>"$GPU_CHECK_OUT/results.jsonl"
}

if [[ "${CONDUIT_GPU_CHECK_SKIP_INSTALL:-0}" == 1 ]]; then
  echo "skip install: CONDUIT_GPU_CHECK_SKIP_INSTALL=1"
else
  step install 40 python scripts/gpu_check/install_plan.py --apply
fi

info=$(python -c "import torch; c = torch.cuda
print(torch.__version__, torch.version.cuda, c.is_available(), c.device_count())")
read -r version cuda available gpus <<<"$info"
if [[ "$cuda" == None ]]; then
  cat >&2 <<EOF
gpu_check: torch $version is a CPU build (torch.version.cuda is None): no CUDA path can run here.
Install a CUDA build of torch from its CUDA wheel index, e.g. for CUDA 12.8:
  pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128
(another CUDA version: https://download.pytorch.org/whl/cu<version>, see https://pytorch.org),
then run this script again.
EOF
  rm -rf "$GPU_CHECK_OUT"
  exit 2
fi
if [[ "$available" != True ]]; then
  echo "gpu_check: torch $version (CUDA $cuda) sees no GPU: torch.cuda.is_available() is False" \
    "(CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset}); check the driver with nvidia-smi" >&2
  rm -rf "$GPU_CHECK_OUT"
  exit 3
fi
echo "ok torch: $version, CUDA $cuda, $gpus GPU(s) visible"
echo "gpu_check: logs and results in $GPU_CHECK_OUT"

had_visible=${CUDA_VISIBLE_DEVICES+1}
all_visible=${CUDA_VISIBLE_DEVICES-}
first=${all_visible:-0}
export CUDA_VISIBLE_DEVICES=${first%%,*}  # one GPU for every step but g.two_gpus

step a.world1 30 python scripts/gpu_check/world1.py
step r.rows 35 python scripts/gpu_check/rows.py
step s.1.sanitizer 40 python scripts/gpu_check/sanitize.py 1
step s.2.sanitizer 50 python scripts/gpu_check/sanitize.py 2
CONDUIT_CUDA_BACKEND=gloo step b.two_ranks 45 \
  torchrun --standalone --nproc_per_node=2 scripts/gpu_check/two_ranks.py
CONDUIT_CUDA_BACKEND=gloo step o.overlap 45 \
  torchrun --standalone --nproc_per_node=2 scripts/gpu_check/overlap.py

dqn=(total_env_steps=3000 algo.learning_starts=500)  # the default experiment: PER, 3-step
ppo=(experiment=cartpole_ppo total_env_steps=4096)
grpo=(experiment=grpo total_env_steps=1024)  # responses: 8 optimiser steps of 128
# train NAME LIMIT_S NPROC OVERRIDE...: one train.py run, checked from its summary
train() { step "d.train.$1" "$2" python scripts/gpu_check/train_run.py "$1" "${@:3}"; }
train dqn-1 35 1 "${dqn[@]}"
train dqn-2 35 2 "${dqn[@]}"
train ppo-1 30 1 "${ppo[@]}"
train grpo-1 30 1 "${grpo[@]}"
train grpo-2 30 2 "${grpo[@]}"
step k.kill_resume 60 python scripts/gpu_check/resume.py
step t.tokens1 25 torchrun --standalone --nproc_per_node=1 scripts/gpu_check/tokens.py
CONDUIT_CUDA_BACKEND=gloo step t.tokens2 30 \
  torchrun --standalone --nproc_per_node=2 scripts/gpu_check/tokens.py
# last of the one-GPU steps: its device-side wait needs the library's NCCL waits on the device
step c.nccl_world1 35 torchrun --standalone --nproc_per_node=1 scripts/gpu_check/nccl_world1.py

if (( gpus >= 2 )); then  # every visible GPU again: one per rank, NCCL between them
  if [[ -n "$had_visible" ]]; then export CUDA_VISIBLE_DEVICES=$all_visible
  else unset CUDA_VISIBLE_DEVICES; fi
  step g.two_gpus 120 torchrun --standalone --nproc_per_node=2 scripts/gpu_check/two_gpus.py
  GPU_CHECK_CUDA_BACKEND=nccl train dqn-2-nccl 60 2 "${dqn[@]}"
else
  skipped g.two_gpus "torch.cuda.device_count() == $gpus: NCCL between ranks and device mapping \
need 2 GPUs (docs/gpu.md, the 2-GPU run)"
fi

GPU_CHECK_FAILED="${failed[*]-}" python scripts/gpu_check/summary.py "$start"
(( ${#failed[@]} == 0 ))
