"""train.py under ``torchrun --max-restarts 1``: a rank killed with SIGKILL, the group restarted,
the job resumed from its last complete checkpoint and finished (scripts/kill_resume.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_kill_nine_resumes_from_the_last_checkpoint(tmp_path):
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "kill_resume.py"), "--steps", "8000",
         "--every-iters", "50", "--dir", str(tmp_path), "--timeout-s", "200"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["finished"] and res["restarted"], res
    resumed = res["resumed"]
    # one round per iteration, and with early start (the default DQN job) the round started
    # after the checkpointed iteration's backward, finished by the checkpoint
    assert resumed["round"] == resumed["iteration"] + resumed["early_round"]
    assert resumed["iteration"] % 50 == 0
    # what the checkpoint held came back; what was put after it is counted as lost
    assert resumed["items_restored"] == resumed["env_steps_at_checkpoint"]
    # at least what rank 0 had recorded before the kill (its log-interval progress record)
    assert res["items_lost"] >= max(
        0, res["env_steps_at_kill"] - resumed["env_steps_at_checkpoint"]
    )
    # the survivor raises RoundError naming the round and rank 1, unless the agent stopped it
    # first (it restarts the group as soon as a worker dies): both were seen here. A rank marks
    # a round only once it has waited in it past a 50 ms grace, so rank 1 killed inside a round
    # it had marked leaves the failing rank unknown: said so, never the wrong rank
    named = ("ranks [1] never reached round", "failing rank unknown")
    assert all(any(n in line for n in named) for line in res["round_error_named"]), res
