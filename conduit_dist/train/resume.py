"""train.py's checkpoints: when to take one, resuming from the newest, the W&B run id, and what
a crash lost.

Every rank calls :meth:`Resumer.after_iteration` at the end of each iteration (nothing is
staged then: the iteration's puts went into its round). A checkpoint is due every
``every_iters`` iterations, or when rank 0 has seen ``every_s`` seconds pass (checked at log
intervals, its decision broadcast on the default group, so every rank checkpoints at the same
iteration). Every rank also records its progress (env steps, iteration) under ``dir`` at every
log interval and when the job fails (a peer's death raises ``RoundError`` on the others), so a
resumed job can say how many env steps the crash lost: put after the checkpoint it resumes
from, so their items are gone.
"""

from __future__ import annotations

import json
import os
import secrets
import time

import torch
import torch.distributed as dist

from conduit_dist.checkpoint import files
from conduit_dist.checkpoint.files import write_json
from conduit_dist.logging import log_rank_zero
from conduit_dist.train.config import CheckpointConfig


def run_id(cfg: CheckpointConfig) -> str | None:
    """The W&B run id this job logs to: kept under ``dir`` so a restarted job resumes the
    same run (rank 0 creates it on the first start); ``None`` without checkpoints."""
    if cfg.dir is None:
        return None
    path = os.path.join(cfg.dir, "wandb_run_id")
    if os.path.exists(path):
        with open(path) as f:
            return f.read().strip()
    os.makedirs(cfg.dir, exist_ok=True)
    rid = secrets.token_hex(4)
    with open(path + ".part", "w") as f:
        f.write(rid)
    os.replace(path + ".part", path)
    return rid


class Resumer:
    """Checkpoints of one training job.

    Args:
        cfg: the ``checkpoint`` settings (``dir`` set).
        plane: the job's data plane.
        rank: this rank.
        log_every: the trainer's log interval (when ``every_s`` is checked).
    """

    def __init__(self, cfg: CheckpointConfig, plane, rank: int, log_every: int) -> None:
        self.cfg, self.plane, self.rank, self.log_every = cfg, plane, rank, log_every
        self.last_t = time.monotonic()
        self.saved = 0  # checkpoints started by this job
        self.resumed: dict[str, object] | None = None  # what the summary reports

    def restore(self) -> dict[str, object] | None:
        """Restore the newest complete checkpoint under ``dir`` if there is one (collective);
        returns its trainer state (``None``: a fresh start)."""
        if files.latest(self.cfg.dir) is None:  # the same answer on every rank (one file system)
            return None
        state = self.plane.restore(self.cfg.dir)
        steps = int(state["env_steps"])
        seen = max([steps, *(int(p["env_steps"]) for p in _progress(self.cfg.dir))])
        self.resumed = {
            "round": self.plane.round,
            "iteration": int(state["iteration"]),
            # a round started early (after the backward) was finished by the checkpoint
            "early_round": bool(state.get("early_round", False)),
            "items_restored": self.plane.stored,
            "env_steps_at_checkpoint": steps,
            "env_steps_lost": max(0, seen - steps),  # put after it by the crashed attempt
        }
        log_rank_zero("resumed from a checkpoint: %s", self.resumed)
        return state

    def after_iteration(self, it: int, env_steps: int, state) -> None:
        """Take a checkpoint if one is due (collective); ``state()`` gives the trainer's."""
        cfg = self.cfg
        due = bool(cfg.every_iters) and it % cfg.every_iters == 0
        if it % self.log_every == 0:
            self.record(it, env_steps)
            if cfg.every_s and not due:
                flag = torch.tensor([int(time.monotonic() - self.last_t >= cfg.every_s)])
                if dist.is_initialized() and dist.get_world_size() > 1:
                    dist.broadcast(flag, 0)
                due = bool(flag.item())
        if due:
            self.plane.checkpoint(
                cfg.dir,
                extra=state(),
                write_mbps=cfg.write_mbps,
                checksum_mbps=cfg.checksum_mbps,
                keep=cfg.keep,
            )
            self.last_t, self.saved = time.monotonic(), self.saved + 1

    def record(self, it: int, env_steps: int) -> None:
        """Note how far this rank got (at log intervals, and when the job fails)."""
        write_json(
            os.path.join(self.cfg.dir, f"progress{self.rank}.json"),
            {"env_steps": env_steps, "iteration": it, "time": time.time()},
        )


def _progress(root: str) -> list[dict]:
    """Every rank's latest progress record under ``root``."""
    found = [_read_json(os.path.join(root, n)) for n in sorted(os.listdir(root))
             if n.startswith("progress") and n.endswith(".json")]  # fmt: skip
    return [p for p in found if p]


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
