"""Vectorized gymnasium environments that yield clean transitions (final observations kept).

Needs gymnasium (the ``[train]`` extra).
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from conduit_dist.errors import ConfigError
from conduit_dist.extras import require

with require("train", "conduit_dist.rl.env"):
    import gymnasium as gym
    from gymnasium.vector import AutoresetMode, SyncVectorEnv


class VectorEnv:
    """``num_envs`` copies of a gymnasium env stepped together, with episode bookkeeping.

    Uses same-step autoreset, so every step yields a valid transition: for an env whose episode
    ended, ``next_obs`` is the episode's final observation and the returned ``obs`` is the reset.

    Args:
        env_id: gymnasium id (e.g. ``CartPole-v1``).
        num_envs: copies.
        seed: base seed; env ``i`` is seeded ``seed + i``.
        streams: also return ``env`` (int64, each copy's index: its stream) and ``truncated``
            (bool), so the data plane can link consecutive transitions (n-step, slices).

    Raises:
        ConfigError: if the id is unknown or its spaces are not a flat Box and a Discrete.
    """

    def __init__(self, env_id: str, num_envs: int, seed: int, streams: bool = False) -> None:
        self.streams = streams
        try:
            fns = [lambda: gym.make(env_id) for _ in range(num_envs)]
            self.env = SyncVectorEnv(fns, autoreset_mode=AutoresetMode.SAME_STEP)
        except gym.error.Error as exc:
            raise ConfigError(f"env.id: gymnasium cannot make {env_id!r}: {exc}") from exc
        obs_space, act_space = self.env.single_observation_space, self.env.single_action_space
        if not isinstance(act_space, gym.spaces.Discrete) or len(obs_space.shape) != 1:
            raise ConfigError(
                f"env.id: expected a flat Box observation and a Discrete action space, got "
                f"{obs_space} and {act_space} for {env_id!r}"
            )
        self.num_envs = num_envs
        self.obs_dim = int(obs_space.shape[0])
        self.n_actions = int(act_space.n)
        obs, _ = self.env.reset(seed=seed)
        self.obs = torch.as_tensor(obs, dtype=torch.float32)
        self._ret = np.zeros(num_envs)
        self.returns: deque[float] = deque(maxlen=100)
        self.episodes = 0

    def step(self, actions: torch.Tensor) -> dict[str, torch.Tensor]:
        """Step every env; returns the transitions and advances ``self.obs``."""
        obs, rew, term, trunc, info = self.env.step(actions.numpy())
        next_obs = obs.copy()
        if "_final_obs" in info:
            for i in np.nonzero(info["_final_obs"])[0]:
                next_obs[i] = info["final_obs"][i]
        batch = {
            "obs": self.obs,
            "action": actions.to(torch.int64),
            "reward": torch.as_tensor(rew, dtype=torch.float32),
            "next_obs": torch.as_tensor(next_obs, dtype=torch.float32),
            "done": torch.as_tensor(term, dtype=torch.bool),  # truncation still bootstraps
        }
        if self.streams:
            batch["env"] = torch.arange(self.num_envs)
            batch["truncated"] = torch.as_tensor(trunc, dtype=torch.bool)
        self._ret += rew
        for i in np.nonzero(term | trunc)[0]:
            self.returns.append(float(self._ret[i]))
            self._ret[i] = 0.0
            self.episodes += 1
        self.obs = torch.as_tensor(obs, dtype=torch.float32)
        return batch

    def close(self) -> None:
        """Close the environments."""
        self.env.close()
