"""The PPO loop behind ``train.py algo=ppo``: rollouts through the data plane, colocated or
disaggregated.

The plane is built from the ``plane`` group by ``setup.build_plane``, as DQN's is (storage
tiers, placement, schedule, lag, timeout, strategy, bandwidth, trace); the settings PPO cannot
honour (another sampler, ``plane.early_start``, ``plane.kind=simple``) are refused at
construction (``setup.check_ppo``, ``setup.sampler``).

Each iteration every acting rank collects ``num_steps`` steps of its ``env.num_envs`` envs with
the newest weights, computes GAE over them (actor side) and ``put``s the rollout, tagged with
its policy version. The plane's ``WithoutReplacement(epochs)`` sampler splits the global
rollout into one block per learner; each learner runs ``epochs x minibatches`` updates, every
minibatch a ``fetch(..., more=True)`` whose round runs behind the previous minibatch's backward
(``max_lag=0``: nothing of the next rollout can enter), and then the rollout leaves the store.
Learners average gradients with DDP and publish the weights after the update.

Disaggregated, actors wait for the new version (``flush`` rounds until ``pull_weights``
returns it), and the learner's first fetch of an iteration waits (``wait_s``) for their
rollout, so every rollout is collected by the policy it trains (age 0, checked on every row by
``max_policy_age``).
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import torch
import torch.distributed as dist

from conduit_dist.errors import ConfigError
from conduit_dist.plane import RoundStats
from conduit_dist.records.spec import ExperienceSpec
from conduit_dist.rl.env import VectorEnv
from conduit_dist.rl.host_weights import HostWeights
from conduit_dist.rl.ppo import PPO, TERMS, rollout_spec_example
from conduit_dist.train import setup
from conduit_dist.train.config import TrainConfig
from conduit_dist.train.metrics import (
    Logger,
    aggregate,
    link_bytes,
    link_metrics,
    store_metrics,
    store_values,
)

log = logging.getLogger("conduit_dist")


class PPOTrainer:
    """Runs PPO with rollouts flowing through a :class:`DataPlane`.

    Args:
        cfg: the validated run config (``algo.name == "ppo"``).
        logger: where rank 0 logs.
        device: the resolved device (``setup.device``; ``None``: resolved here): the network
            lives and learns there, the plane delivers minibatches there, the learners average
            the flat gradients there; rollouts are collected on the host.

    Raises:
        ConfigError: when the rollout does not split into equal minibatches per learner, on
            ``plane.kind=simple``, ``plane.early_start=true`` or a ``plane.sampler`` other
            than ``auto`` or ``without_replacement`` (PPO's sampler is ``WithoutReplacement``
            built from ``algo.ppo``), or on settings the plane refuses.
    """

    DONE_KEYS = ("env_steps", "wall_s", "return_100", "reached_target")  # train.py's done line

    def __init__(
        self, cfg: TrainConfig, logger: Logger, device: torch.device | None = None
    ) -> None:
        self.cfg, self.logger, p = cfg, logger, cfg.algo.ppo
        setup.check_ppo(cfg)
        self.device = device if device is not None else setup.device(cfg)
        sampler = setup.sampler(cfg)  # before anything is built: refuses other samplers
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        learners = setup.learner_ranks(cfg, self.world)
        self.learners = learners
        self.is_learner = self.rank in learners
        self.is_actor = cfg.mode == "colocated" or not self.is_learner
        self.n_actors = self.world if cfg.mode == "colocated" else self.world - len(learners)
        self.rollout = p.num_steps * cfg.env.num_envs * self.n_actors
        per = self.rollout // p.minibatches
        if self.rollout % (p.minibatches * len(learners)):
            raise ConfigError(
                f"algo.ppo.minibatches: the {self.rollout}-item rollout (num_steps x "
                f"env.num_envs x {self.n_actors} acting ranks) must split into {p.minibatches} "
                f"minibatches over {len(learners)} learners, got {per} per minibatch"
            )
        self.minibatch = per // len(learners)
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        self.gen = torch.Generator().manual_seed(cfg.seed * 7919 + self.rank)
        self.env = (
            VectorEnv(cfg.env.id, cfg.env.num_envs, cfg.seed + 1000 * self.rank, streams=True)
            if self.is_actor
            else None
        )
        probe = self.env or VectorEnv(cfg.env.id, 1, cfg.seed)
        obs_dim, n_actions = probe.obs_dim, probe.n_actions
        if probe is not self.env:
            probe.close()
        ddp = None
        if len(learners) > 1:  # collective: every rank calls new_group
            ddp = dist.group.WORLD if len(learners) == self.world else dist.new_group(learners)
        self.agent = PPO(
            cfg.algo, obs_dim, n_actions, ddp if self.is_learner else None, self.device
        )
        self.weights = HostWeights(self.agent.net, self.device)  # published, pulled on the host
        self.plane = setup.build_plane(
            cfg,
            ExperienceSpec.from_batch(rollout_spec_example(obs_dim)),
            learners,
            sampler,
            dev=self.device,
            max_policy_age=p.max_policy_age,
        )
        if self.is_learner:
            self.plane.attach(self.agent.learner)
        self.env_steps = 0
        self.version = 0
        self.max_age = 0  # the oldest policy age of any item this learner was given

    def run(self) -> dict[str, object]:
        """Train for ``total_env_steps`` (or until ``target_return``); returns a summary."""
        cfg = self.cfg
        iters = math.ceil(cfg.total_env_steps / self.rollout)
        start = time.perf_counter()
        window = self._window = _Window()
        summary: dict[str, object] = {"return_100": float("nan"), "reached_target": False}
        if cfg.mode == "disaggregated":  # the actors' first weights
            if self.is_learner:
                self.version = self.weights.publish(self.plane)
            self._hand_over(1)
        it = 0
        for it in range(1, iters + 1):
            self.agent.set_lr(1.0 - (it - 1) / iters)
            self._iteration(window, it)
            if it % cfg.logger.log_every == 0 or it == iters:
                summary = {"reached_target": False, **self._log(window)}
                window = self._window = _Window()
                target = cfg.target_return
                if target is not None and summary["return_100"] >= target:
                    summary["reached_target"] = True
                    break
        wall = time.perf_counter() - start
        agg = aggregate({"max_age": float(self.max_age)})
        summary.update(
            env_steps=self.env_steps, wall_s=wall, iterations=it,
            time_to_target_s=wall if summary["reached_target"] else None,
            env_steps_per_s=self.env_steps / wall, max_policy_age_seen=agg["max_age_max"],
            stale_evicted=self.plane.store_stats()["stale_evicted"],
        )  # fmt: skip
        return summary

    def _iteration(self, window: _Window, it: int) -> None:
        t0 = time.perf_counter()
        if self.is_actor:
            self.plane.put(self._collect())
        self.env_steps += self.rollout
        if self.is_learner:
            self._learn(window)
            self.version = self.weights.publish(self.plane)
        if self.cfg.mode == "disaggregated":
            self._hand_over(it + 1)
        window.iteration_ms.append((time.perf_counter() - t0) * 1e3)
        window.iterations += 1

    def _hand_over(self, version: int) -> None:
        """Disaggregated: the round that ingests the actors' rollout, then one that carries the
        learner's new weights; actors run rounds until ``pull_weights`` returns ``version``, so
        every rank leaves the iteration in the same round."""
        if self.is_learner:
            self.plane.flush()
            self.plane.wait()
            self._window.add_round(self.plane.stats)
            return
        self.plane.flush()  # ingests the rollout (the learner's first fetch waits for it)
        self.plane.wait()  # every actor pulls after the same round: rollouts arrive together
        self._window.add_round(self.plane.stats)
        while self.weights.pull(self.plane) < version:
            self.plane.flush()
            self.plane.wait()
            self._window.add_round(self.plane.stats)

    @torch.no_grad()
    def _collect(self) -> dict[str, torch.Tensor]:
        steps = []
        for _ in range(self.cfg.algo.ppo.num_steps):
            out = self.agent.act(self.env.obs, self.gen)
            steps.append({**self.env.step(out["action"]), **out})
        return self.agent.finish_rollout(steps)

    def _learn(self, window: _Window) -> None:
        p = self.cfg.algo.ppo
        n = p.epochs * p.minibatches
        wait_s = p.wait_s if self.cfg.mode == "disaggregated" else 0.0
        for k in range(n):
            t0 = time.perf_counter()
            batch = self.plane.fetch(self.minibatch, more=k < n - 1, wait_s=wait_s if k == 0 else 0)
            window.exposed_ms.append((time.perf_counter() - t0) * 1e3)
            timing = self.plane.last_fetch
            window.hidden_ms.append(timing.hidden_ms if timing is not None else 0.0)
            window.add_round(self.plane.stats)
            # against this learner's own version; read at the log (no host sync per minibatch)
            window.ages.append(self.version - batch["_version"])
            loss = self.agent.loss(batch)
            loss.backward()
            self.agent.step()
            window.losses.append(self.agent.last)

    def _log(self, window: _Window) -> dict[str, float]:
        """Aggregate the window over ranks (a collective) and log on rank 0."""
        elapsed = max(time.perf_counter() - window.start, 1e-9)
        returns = list(self.env.returns) if self.env is not None else []
        recent = returns[-math.ceil(100 / self.n_actors) :]
        iters = max(window.iterations, 1)
        ages = window.policy_ages()  # one host read of the window's ages, one of its losses
        self.max_age = max(self.max_age, max(ages, default=0))
        terms = window.loss_terms()
        store = self.plane.store_stats()
        local = {
            "ret_sum": sum(recent), "ret_n": len(recent),
            "exposed_ms": _mean(window.exposed_ms), "iteration_ms": _mean(window.iteration_ms),
            "hidden_ms": _mean(window.hidden_ms), "age_max": max(ages, default=0),
            "iter_exposed": sum(window.exposed_ms) / iters,
            "iter_hidden": sum(window.hidden_ms) / iters,
            **terms,
            **link_bytes(window.sent, self.plane.topology.link_matrix()[self.rank]),
            **store_values(store),
        }  # fmt: skip
        agg = aggregate(local)
        n = agg["ret_n_mean"] * self.world
        ret100 = agg["ret_sum_mean"] * self.world / n if n else float("nan")
        nl = len(self.learners) / self.world  # learner values, averaged over learners only
        metrics = {
            "rl/episode_return_100": ret100,
            "rate/env_steps_per_s": self.rollout * window.iterations / elapsed,
            "train/pg_loss": agg["pg_mean"] / nl,
            "train/value_loss": agg["v_mean"] / nl,
            "train/entropy": agg["entropy_mean"] / nl,
            "train/clipfrac": agg["clipfrac_mean"] / nl,
            "train/policy_version": float(self.version),
            "train/lr": self.agent.opt.param_groups[0]["lr"],
            "path/exposed_ms_mean": agg["exposed_ms_mean"] / nl,  # per fetch
            "path/hidden_ms_mean": agg["hidden_ms_mean"] / nl,
            "path/iter_exposed_ms": agg["iter_exposed_mean"] / nl,  # per iteration
            "path/iter_hidden_ms": agg["iter_hidden_mean"] / nl,
            "path/iteration_ms_mean": agg["iteration_ms_mean"],
            "path/policy_age_max": agg["age_max_max"],
            **link_metrics(agg, self.world),
            **store_metrics(agg, store, self.world),
        }
        hists = {"path/policy_age_hist": ages, "path/exposed_ms_hist": window.exposed_ms}
        self.logger.log(metrics, self.env_steps, hists)
        return {"return_100": ret100, **metrics}

    def close(self) -> None:
        """Export the trace (if configured), close the plane and the environments."""
        if self.cfg.plane.trace_dir:
            self.plane.export_trace(f"{self.cfg.plane.trace_dir}/trace_rank{self.rank}.json")
        self.plane.close()
        if self.env is not None:
            self.env.close()


class _Window:
    """Per-iteration measurements between two logs."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.iterations = 0
        self.exposed_ms: list[float] = []
        self.hidden_ms: list[float] = []
        self.sent: np.ndarray | None = None  # bytes the rounds sent each rank
        self._round = -1
        self.iteration_ms: list[float] = []
        self.ages: list[torch.Tensor] = []  # per minibatch, on the learner's device
        self.losses: list[torch.Tensor] = []  # per minibatch, [len(TERMS)], likewise

    def policy_ages(self) -> list[int]:
        """The fetched items' policy ages, in order (one host read)."""
        return torch.cat(self.ages).tolist() if self.ages else []

    def loss_terms(self) -> dict[str, float]:
        """The mean of each of ``rl.ppo.TERMS`` over the window's minibatches (one host read;
        0.0 without any)."""
        if not self.losses:
            return dict.fromkeys(TERMS, 0.0)
        means = torch.stack(self.losses).double().mean(0).tolist()
        return dict(zip(TERMS, means, strict=True))

    def add_round(self, stats: RoundStats) -> None:
        """Count a finished round's bytes sent (once per round)."""
        if stats.round != self._round and stats.sent is not None:
            self.sent = stats.sent.copy() if self.sent is None else self.sent + stats.sent
        self._round = stats.round


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
