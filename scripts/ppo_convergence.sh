#!/usr/bin/env bash
# PPO convergence on CartPole, 3 seeds each: colocated on 2 ranks, disaggregated on 3 ranks
# (learner 0, 2 actors) and the CleanRL-style single-process baseline, one after another.
# bash scripts/ppo_convergence.sh [OUT_DIR]   -> OUT_DIR/*.json, one summary per run, and a
# JSON line last with the medians.
set -euo pipefail
out=${1:-outputs/ppo_convergence}
mkdir -p "$out"
common=(experiment=cartpole_ppo logger=console plane.calibrate=false)
for seed in 0 1 2; do
  torchrun --standalone --nproc_per_node=2 train.py "${common[@]}" seed=$seed \
    logger.summary_path="$out/colocated_$seed.json" > "$out/colocated_$seed.log" 2>&1
  torchrun --standalone --nproc_per_node=3 train.py "${common[@]}" seed=$seed \
    mode=disaggregated 'learner_ranks=[0]' \
    logger.summary_path="$out/disaggregated_$seed.json" > "$out/disaggregated_$seed.log" 2>&1
  python scripts/cleanrl_ppo.py --seed $seed | tail -1 > "$out/cleanrl_$seed.json"
done
python - "$out" <<'PY'
import json, statistics, sys
out = sys.argv[1]
res = {}
for kind in ("colocated", "disaggregated", "cleanrl"):
    runs = [json.load(open(f"{out}/{kind}_{s}.json")) for s in range(3)]
    res[kind] = {
        "return_100": [round(r["return_100"], 1) for r in runs],
        "wall_s": [round(r["wall_s"], 1) for r in runs],
        "median_return_100": statistics.median(r["return_100"] for r in runs),
        "median_wall_s": statistics.median(r["wall_s"] for r in runs),
    }
    if kind != "cleanrl":
        res[kind]["max_policy_age_seen"] = max(r["max_policy_age_seen"] for r in runs)
print(json.dumps(res))
PY
