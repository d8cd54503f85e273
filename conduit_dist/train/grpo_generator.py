"""``python train.py experiment=grpo algo.grpo.role=generator algo.grpo.attach_dir=DIR``: one
GRPO generator outside the job (docs/attach.md), for learners launched with
``mode=disaggregated algo.grpo.generators=attached`` (every rank of the job learns and opens an
ingress in ``DIR``).

It builds the same policy and task as the learners (the same seed: the same initial weights,
version 0), attaches to an ingress, and loops: pull the newest weights when the ingress reports
a newer version, generate ``gen_groups`` prompt groups on training prompts (never the held-out
ones), score them and ``put`` them tagged with the version they were generated with, each chunk
``reserve``d first: the learners' ingresses grant ``prompts_per_step`` groups a version,
``max_policy_age + 1`` versions ahead, so nothing it puts is dropped for age unless several
generators together outrun the learners (then the plane evicts and counts it:
``dropped_stale`` in the learners' done line). It stops when the learners close the plane, and
prints its own done line.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import zlib

import numpy as np
import torch

import conduit_dist as cd
from conduit_dist.errors import ConfigError, RoundError
from conduit_dist.rl.grpo import VOCAB, sample_groups, to_token_batch
from conduit_dist.rl.grpo_eval import PromptSplit
from conduit_dist.rl.lm import LMConfig, TinyLM
from conduit_dist.train.config import TrainConfig
from conduit_dist.train.grpo_config import check_attach

log = logging.getLogger("conduit_dist")


class GRPOGenerator:
    """One attached GRPO generator (module docstring).

    Args:
        cfg: the run config (``algo.grpo.role == "generator"``).

    Raises:
        ConfigError: without ``algo.grpo.attach_dir`` or on bad attach settings.
    """

    DONE_KEYS = ("producer", "groups", "versions_seen", "reward_mean", "wall_s", "resent")

    def __init__(self, cfg: TrainConfig) -> None:
        check_attach(cfg)
        if cfg.algo.name != "grpo":
            raise ConfigError(
                f"algo.grpo.role=generator: expected algo=grpo, got {cfg.algo.name!r}"
            )
        g = self.g = cfg.algo.grpo
        self.cfg = cfg
        self.gcfg = g.to_config(cfg.algo.lr, cfg.algo.max_grad_norm, cfg.seed)
        self.split = PromptSplit(g.eval_prompts, g.max_digits, g.eval_seed)
        lm = LMConfig(VOCAB, g.d_model, g.n_layers, g.n_heads, g.max_digits + 1 + g.max_new)
        torch.manual_seed(cfg.seed)  # the learners' initial weights: version 0
        self.policy = TinyLM(lm)
        self.producer = f"gen-{socket.gethostname()}-{os.getpid()}"
        tag = zlib.crc32(self.producer.encode())
        self.rng = np.random.default_rng([cfg.seed, tag])
        self.gen = torch.Generator().manual_seed(cfg.seed * 7919 + tag)
        self.base = (tag & 0x3FFFFFFF) << 24  # group ids of its own (no job rank's range)

    def run(self) -> dict[str, object]:
        """Generate until the learners close the plane; returns the done line's values."""
        g, start = self.g, time.perf_counter()
        p = cd.attach(g.attach_dir, "tokens", producer=self.producer,
                      timeout_s=self.cfg.plane.timeout_s)  # fmt: skip
        n_groups, rewards, seen = 0, [], set()
        try:
            while True:
                n = min(g.gen_groups, g.prompts_per_step)
                version = p.reserve(n, self.policy)  # paced by the learners' version
                seen.add(version)
                ids = [self.base + n_groups + i for i in range(n)]
                t0 = time.perf_counter()
                prompts = self.split.train(n, self.rng)
                groups = sample_groups(self.policy, prompts, g.group_size, g.max_new, self.gen)
                batch, lengths = to_token_batch(groups, ids, g.adv_eps)
                batch["gen_ms"] = torch.full(
                    (len(lengths),), (time.perf_counter() - t0) * 1e3 / len(lengths)
                )
                p.put(batch, lengths, version=version)
                rewards += batch["reward"].tolist()
                n_groups += n
        except (RoundError, ConnectionError) as exc:  # the learners closed the plane
            log.info("generator %s: %s", self.producer, exc)
        finally:
            p.close()
        return {
            "producer": self.producer, "groups": n_groups, "versions_seen": len(seen),
            "reward_mean": float(np.mean(rewards)) if rewards else 0.0,
            "wall_s": round(time.perf_counter() - start, 1), "resent": p.resent,
        }  # fmt: skip
