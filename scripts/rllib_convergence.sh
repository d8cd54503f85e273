#!/usr/bin/env bash
# RLlib's tuned CartPole DQN with RLlib's prioritized buffer and with the plane's, 3 seeds each,
# in one sitting, two runs at a time (a conduit run beside an RLlib run of the same seed), then
# the summary: env steps to the 450 target per run and the ratio of the medians.
#   scripts/rllib_convergence.sh [OUT_DIR] [SEEDS...]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-outputs/rllib_convergence}
shift || true
seeds=${*:-0 1 2}
mkdir -p "$out"
for s in $seeds; do printf 'conduit %s\nrllib %s\n' "$s" "$s"; done |
  xargs -P 2 -L 1 bash -c 'OMP_NUM_THREADS=1 python examples/rllib_dqn.py --buffer "$0" --seed "$1" > "'"$out"'/$0-$1.log" 2>&1'
python - "$out" <<'PY'
import json, statistics, sys, pathlib
runs = {}
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.log")):
    last = [l for l in f.read_text().splitlines() if l.startswith("{")][-1]
    r = json.loads(last)
    runs.setdefault(r["buffer"], []).append(r)
summary = {}
for b, rs in runs.items():
    steps = [r["steps_to_target"] for r in rs]
    done = [s for s in steps if s is not None]
    summary[b] = {"steps_to_target": steps, "reached": f"{len(done)}/{len(steps)}",
                  "median_steps": statistics.median(done) if len(done) == len(steps) else None,
                  "wall_s": [r["wall_s"] for r in rs]}
ratio = None
if all(summary.get(b, {}).get("median_steps") for b in ("conduit", "rllib")):
    ratio = summary["conduit"]["median_steps"] / summary["rllib"]["median_steps"]
print(json.dumps({"runs": summary, "conduit_over_rllib_median_steps": ratio}))
PY
