"""``python train.py experiment=cartpole_dqn algo.role=actor algo.attach_dir=DIR``: one DQN actor
outside the job (docs/attach.md), for learners launched with ``mode=disaggregated
algo.actors=attached`` (every rank of the job learns and opens an ingress in ``DIR``).

It steps its own ``env.num_envs`` environments with the learners' network (the same seed: the
same initial weights), puts each step's transitions (the rows a job's actor rank puts) through
its ingress, and pulls the newest weights when the ingress reports a newer version. Its
exploration decays over its own env steps. It stops when the learners close the plane, and
prints its own done line (env steps, episodes, the mean return of its last 100).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import zlib

import torch

import conduit_dist as cd
from conduit_dist.errors import ConfigError, RoundError
from conduit_dist.rl.dqn import DQN
from conduit_dist.rl.env import VectorEnv
from conduit_dist.train.config import TrainConfig

log = logging.getLogger("conduit_dist")


class DQNActor:
    """One attached DQN actor (module docstring).

    Args:
        cfg: the run config (``algo.role == "actor"``; checked by ``config.validate``).

    Raises:
        ConfigError: on an algorithm other than DQN.
    """

    DONE_KEYS = ("producer", "env_steps", "episodes", "return_100", "versions_seen", "wall_s")

    def __init__(self, cfg: TrainConfig) -> None:
        if cfg.algo.name != "dqn":
            raise ConfigError(f"algo.role=actor: expected algo=dqn, got {cfg.algo.name!r}")
        self.cfg = cfg
        self.producer = f"actor-{socket.gethostname()}-{os.getpid()}"
        tag = zlib.crc32(self.producer.encode()) & 0x7FFFFFFF
        env = self.env = VectorEnv(
            cfg.env.id, cfg.env.num_envs, cfg.seed + tag, cfg.algo.n_step > 1
        )
        torch.manual_seed(cfg.seed)  # the learners' initial network: version 0
        self.agent = DQN(cfg.algo, env.obs_dim, env.n_actions, None, False, torch.device("cpu"))
        self.gen = torch.Generator().manual_seed(cfg.seed * 7919 + tag)

    def run(self) -> dict[str, object]:
        """Act until the learners close the plane; returns the done line's values."""
        cfg, start = self.cfg, time.perf_counter()
        p = cd.attach(cfg.algo.attach_dir, "rows", producer=self.producer,
                      timeout_s=cfg.plane.timeout_s)  # fmt: skip
        steps, versions, version = 0, set(), 0
        try:
            version = p.pull_weights(self.agent.q)
            while True:
                if p.version > version:  # the learners published: the newest network
                    version = p.pull_weights(self.agent.q)
                versions.add(version)
                eps = self.agent.epsilon(steps)
                actions = self.agent.act(self.env.obs, eps, self.gen)
                p.put(self.env.step(actions), version=version)
                steps += cfg.env.num_envs
        except (RoundError, ConnectionError) as exc:  # the learners closed the plane
            log.info("actor %s: %s", self.producer, exc)
        finally:
            p.close()
            self.env.close()
        returns = list(self.env.returns)[-100:]
        return {
            "producer": self.producer, "env_steps": steps, "episodes": self.env.episodes,
            "return_100": sum(returns) / len(returns) if returns else float("nan"),
            "versions_seen": len(versions), "wall_s": round(time.perf_counter() - start, 1),
        }  # fmt: skip
