"""The training loop behind ``train.py``: DQN through the data plane, colocated or disaggregated."""

from __future__ import annotations

import json
import logging
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist

from conduit_dist.errors import ConfigError
from conduit_dist.plane import DataPlane
from conduit_dist.records.spec import VERSION
from conduit_dist.rl.dqn import DQN
from conduit_dist.rl.env import VectorEnv
from conduit_dist.rl.host_weights import HostWeights
from conduit_dist.train import setup
from conduit_dist.train.breakdown import PARTS, Breakdown
from conduit_dist.train.config import TrainConfig
from conduit_dist.train.metrics import Logger, aggregate, link_metrics, store_metrics, store_values
from conduit_dist.train.resume import Resumer
from conduit_dist.train.window import Window, phase_metrics

log = logging.getLogger("conduit_dist")


class Trainer:
    """Runs DQN with experience flowing through a :class:`DataPlane` (or the simple baseline).

    Args:
        cfg: the validated run config.
        logger: where rank 0 logs (a no-op logger on other ranks).
        device: the resolved device (``setup.device``; ``None``: resolved here): the networks
            live and learn there and the plane delivers there; environments step on the host.

    Raises:
        ConfigError: on an inconsistent mode / learner ranks / world size, or a device or
            gradient averaging that cannot work together (``setup.grad_sync``).
    """

    DONE_KEYS = ("env_steps", "wall_s", "return_100", "reached_target")  # train.py's done line

    def __init__(
        self, cfg: TrainConfig, logger: Logger, device: torch.device | None = None
    ) -> None:
        self.cfg, self.logger = cfg, logger
        self.device = device if device is not None else setup.device(cfg)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        learners = setup.learner_ranks(cfg, self.world)
        self.is_learner = self.rank in learners
        if cfg.algo.batch_size % len(learners):
            raise ConfigError(
                f"algo.batch_size: expected a multiple of the {len(learners)} learners (each "
                f"fetches an equal share of the update's batch), got {cfg.algo.batch_size}"
            )
        self.batch_per_learner = cfg.algo.batch_size // len(learners)
        # actors outside the job (algo.actors=attached): every rank learns; env steps are what
        # the ranks' ingresses acknowledged, summed (a collective each iteration)
        self.attached = cfg.algo.name == "dqn" and cfg.algo.actors == "attached"
        self.is_actor = not self.attached and (cfg.mode == "colocated" or not self.is_learner)
        self.n_actors = self.world if cfg.mode == "colocated" else self.world - len(learners)
        torch.manual_seed(cfg.seed + self.rank)
        self.gen = torch.Generator().manual_seed(cfg.seed * 7919 + self.rank)
        probe = VectorEnv(cfg.env.id, 1, cfg.seed)
        obs_dim, n_actions = probe.obs_dim, probe.n_actions
        probe.close()
        self.env = (
            VectorEnv(
                cfg.env.id, cfg.env.num_envs, cfg.seed + 1000 * self.rank, cfg.algo.n_step > 1
            )
            if self.is_actor
            else None
        )
        self.grad_sync = setup.grad_sync(cfg, learners, self.device)
        ddp = self._ddp_group(learners) if self.grad_sync != "round" else None
        self.agent = DQN(cfg.algo, obs_dim, n_actions, ddp, self.grad_sync == "round", self.device)
        self.weights = HostWeights(self.agent.q, self.device)  # published and pulled on the host
        self._grads_pending = False  # grad_sync=round: gradients waiting for the next fetch
        # grad_sync=round: start each round after the backward, finish it at the next fetch
        self.early = setup.early_start(cfg, self.grad_sync)
        self._start_ms = 0.0  # the last fetch_start's time: exposed, charged to its fetch
        if self.rank == 0:
            log.info(
                "learners average gradients with grad_sync=%s; rounds start %s",
                self.grad_sync,
                "right after the backward (plane.early_start)" if self.early else "in fetch",
            )
        self.plane = setup.make_plane(
            cfg,
            obs_dim,
            learners,
            self.grad_sync,
            self.agent.flat.numel() if self.agent.flat is not None else 0,
            self.device,
        )
        if self.attached:  # window 1: an actor runs one env step ahead of the learners'
            # iterations at most (each iteration stores what it sent and acknowledges it), the
            # lockstep an actor rank keeps
            self.plane.open_ingress(cfg.algo.attach_dir, window=1)
        self.prioritized = setup.sampler_name(cfg) == "prioritized" and self.is_learner
        if isinstance(self.plane, DataPlane) and self.is_learner:
            self.plane.attach(self.agent.learner)
        self.records: list[tuple[float, float, float]] = []  # (iteration, exposed, hidden) ms
        self.breakdown = Breakdown()  # windows spent wholly learning (the steady state)
        self.env_steps = 0
        self.policy_version = 0
        self.resumer = (
            Resumer(cfg.checkpoint, self.plane, self.rank, cfg.logger.log_every)
            if cfg.checkpoint.dir is not None
            else None
        )

    def _anneal_beta(self) -> None:
        """Move ``beta`` linearly from ``plane.prioritized.beta`` to ``beta_end``."""
        pr = self.cfg.plane.prioritized
        frac = min(1.0, self.env_steps / self.cfg.total_env_steps)
        self.plane.sampler.beta = pr.beta + (pr.beta_end - pr.beta) * frac

    def _ddp_group(self, learners: list[int]):
        if len(learners) < 2:
            return None
        if len(learners) == self.world:
            return dist.group.WORLD
        group = dist.new_group(learners)  # collective: every rank calls it
        return group if self.is_learner else None

    # ------------------------------------------------------------------ loop

    def run(self) -> dict[str, float]:
        """Train until ``total_env_steps`` or ``target_return``; returns a summary."""
        cfg = self.cfg
        steps_per_iter = cfg.env.num_envs * self.n_actors
        # attached actors: as many iterations as it takes (the loop ends on the env steps)
        iters = 2**62 if self.attached else math.ceil(cfg.total_env_steps / steps_per_iter)
        start, window, it = time.perf_counter(), Window(), 0
        summary = {"return_100": float("nan"), "reached_target": False}
        first = self._resume() + 1
        if cfg.mode == "disaggregated" and self.is_learner:
            self.weights.publish(self.plane)
        for it in range(first, iters + 1):
            try:
                self._iteration(window)
            except BaseException:
                if self.resumer is not None:  # how far this rank got: what a resume lost
                    self.resumer.record(it, self.env_steps)
                raise
            if self.resumer is not None:
                self.resumer.after_iteration(it, self.env_steps, lambda it=it: self._state(it))
            done = self.attached and self.env_steps >= cfg.total_env_steps
            if it % cfg.logger.log_every == 0 or it == iters or done:
                summary = {"reached_target": False, **self._log(window)}
                if window.learning_iterations == window.iterations:
                    self.breakdown.merge(window.breakdown)
                window = Window(env_steps0=self.env_steps)
                if cfg.target_return is not None and summary["return_100"] >= cfg.target_return:
                    summary["reached_target"] = True
                    break
            if done:
                break
        wall = time.perf_counter() - start
        summary.update(env_steps=self.env_steps, wall_s=wall, iterations=it)
        if self.resumer is not None:
            summary["resumed"] = self.resumer.resumed
            summary["checkpoints"] = self.resumer.saved
        summary["time_to_target_s"] = wall if summary["reached_target"] else None
        summary["env_steps_per_s"] = self.env_steps / wall
        agg = aggregate(self.breakdown.means())  # a collective: every rank ends here
        summary["breakdown_ms"] = {p: agg[f"{p}_mean"] for p in PARTS}
        summary["breakdown_ms_max"] = {p: agg[f"{p}_max"] for p in PARTS}
        summary["schedule"] = getattr(self.plane, "chosen_schedule", "none")
        summary["grad_sync"] = self.grad_sync
        summary["breakdown_iterations"] = self.breakdown.iterations
        if isinstance(self.plane, DataPlane):  # e.g. priority updates applied on this shard
            stats = self.plane.store_stats()
            summary["sampler"] = {k: v for k, v in stats.items() if k.startswith("priority")}
        return summary

    def _state(self, it: int) -> dict[str, object]:
        """What a checkpoint keeps of this rank's training (beside the data plane)."""
        return {
            "rank": self.rank,
            "iteration": it,
            "env_steps": self.env_steps,
            "agent": self.agent.state_dict(),
            "policy_version": self.policy_version,
            "gen": self.gen.get_state(),
            "torch_rng": torch.get_rng_state(),
            "returns": list(self.env.returns) if self.env is not None else [],
            "episodes": self.env.episodes if self.env is not None else 0,
            # early start: the round fetch_start began after this iteration's backward is
            # finished by the checkpoint (so it holds one round more than iterations); its
            # batch and the gradients it averaged are not kept
            "early_round": bool(self.early and self._grads_pending),
        }

    def _resume(self) -> int:
        """Restore the newest checkpoint if there is one; returns its iteration (0: none).
        The environments start new episodes (an episode in progress is not kept), and the
        gradients of an update in flight at the checkpoint (``grad_sync=round``) are dropped,
        with early start the batch of the round started after its backward too (the store
        keeps every item: a resumed job draws its first batch afresh)."""
        state = self.resumer.restore() if self.resumer is not None else None
        if state is None:
            return 0
        self.agent.load_state_dict(state["agent"])
        self.env_steps, self.policy_version = int(state["env_steps"]), int(state["policy_version"])
        if int(state["rank"]) == self.rank:  # a new rank (larger world) keeps its own seeds
            self.gen.set_state(state["gen"])
            torch.set_rng_state(state["torch_rng"])
            if self.env is not None:
                self.env.returns.extend(state["returns"])
                self.env.episodes = int(state["episodes"])
        return int(state["iteration"])

    def _iteration(self, window: Window) -> None:
        cfg, bd = self.cfg, window.breakdown
        bd.begin()
        if self.is_actor:
            eps = self.agent.epsilon(self.env_steps)
            actions = self.agent.act(self.env.obs, eps, self.gen)
            bd.lap("act")
            batch = self.env.step(actions)
            bd.lap("env")
            self.plane.put(batch)
            bd.lap("put")
        if self.attached:  # what every rank's ingress acknowledged (one all_reduce)
            self.env_steps = self._attached_items()
        else:
            self.env_steps += cfg.env.num_envs * self.n_actors
        learning = self.env_steps >= cfg.algo.learning_starts
        learned, exposed_ms, hidden_ms = False, 0.0, 0.0
        for _ in range(cfg.algo.updates_per_iter if learning else 1):
            if learning and self.is_learner:
                deferred = self.grad_sync == "round"
                pending = deferred and self._grads_pending
                reduce = self.agent.flat if pending and not self.early else None
                t0 = time.perf_counter()
                if reduce is not None:  # the last backward's gradients, averaged in this round
                    batch = self.plane.fetch(self.batch_per_learner, reduce=reduce)
                else:  # early start: the round started after the last backward carried them
                    batch = self.plane.fetch(self.batch_per_learner)
                timing = getattr(self.plane, "last_fetch", None)
                # an early-started round's set-up ran in fetch_start: exposed too
                wait_ms = (time.perf_counter() - t0) * 1e3 + self._start_ms
                self._start_ms = 0.0
                bd.lap("exposed")
                hidden_ms = timing.hidden_ms if timing is not None else 0.0
                window.add(self.plane.stats, wait_ms, hidden_ms)
                if VERSION in batch:  # policy age: the newest version minus the item's
                    window.ages.append(self.plane.policy_version - batch[VERSION])
                exposed_ms, learned = wait_ms, True
                if pending:
                    self._update(bd)
                loss = self.agent.loss(batch)
                if self.prioritized:  # |TD error| back to the shards that hold the items
                    self.plane.update_priorities(batch["_index"], self.agent.last_td)
                    self._anneal_beta()
                bd.lap("forward")
                loss.backward()
                bd.lap("backward")
                if deferred:
                    self._grads_pending = True
                    if self.early:  # the exchange flies while the next env step runs
                        t0 = time.perf_counter()
                        self.plane.fetch_start(self.batch_per_learner, reduce=self.agent.flat)
                        self._start_ms = (time.perf_counter() - t0) * 1e3
                        bd.lap("exposed")
                else:
                    self._update(bd)
                window.learner_steps += 1
                window.losses.append(loss.detach())  # read at the log: no sync per step
            else:
                t0 = time.perf_counter()
                self.plane.flush()
                window.add(self.plane.stats, (time.perf_counter() - t0) * 1e3)
                bd.lap("exposed")
                if self.attached and not learning:  # waiting for the actors' first steps
                    time.sleep(0.01)
            bd.add("round_cpu", getattr(self.plane.stats, "cpu_ms", 0.0))
        if cfg.mode == "disaggregated" and not self.is_learner:
            self.policy_version = self.weights.pull(self.plane)
            bd.lap("publish")
        if self.agent.grad_sync is not None:
            bd.add("ddp", self.agent.grad_sync.take_ms())
        window.iterations += 1
        iter_ms = bd.end()
        window.ms["iteration"].append(iter_ms)
        if learned:
            self.records.append((iter_ms, exposed_ms, hidden_ms))
        if learning:
            window.learning_iterations += 1

    def _attached_items(self) -> int:
        """Rows every rank's ingress acknowledged from the attached actors (a collective)."""
        t = torch.tensor([self.plane.ingress.totals()["attached_items"]], dtype=torch.int64)
        if dist.is_initialized() and self.world > 1:
            dist.all_reduce(t)
        return int(t.item())

    def _update(self, bd: Breakdown) -> None:
        """The optimizer step (and, disaggregated, publishing the weights every few steps)."""
        self.agent.step()
        bd.lap("optimizer")
        if self.cfg.mode == "disaggregated" and self.agent.steps % self.cfg.algo.publish_every == 0:
            self.policy_version = self.weights.publish(self.plane)
            bd.lap("publish")

    def _log(self, window: Window) -> dict[str, float]:
        """Aggregate the window over ranks (a collective) and log on rank 0."""
        elapsed = max(time.perf_counter() - window.start, 1e-9)
        returns = list(self.env.returns) if self.env is not None else []
        recent = returns[-math.ceil(100 / max(self.n_actors, 1)) :]
        ages = window.policy_ages()
        plane = self.plane if isinstance(self.plane, DataPlane) else None
        links = plane.topology.link_matrix()[self.rank] if plane else np.zeros(1, np.int64)
        local = {
            "ret_sum": sum(recent),
            "ret_n": len(recent),
            "episodes": self.env.episodes if self.env is not None else 0,
            "items": self.plane.stored,
            **window.values(elapsed, ages, links),
        }
        store = plane.store_stats() if plane else None
        local.update(store_values(store))
        attached = sorted(k for k in (store or {}) if k.startswith("attached_"))
        local.update({k: float(store[k]) for k in attached})  # the ledger, summed below
        agg = aggregate(local)
        world = self.world
        n = agg["ret_n_mean"] * world
        ret100 = agg["ret_sum_mean"] * world / n if n else float("nan")
        capacity = self.cfg.plane.capacity_per_rank * (world if plane else 1)
        metrics = {
            "rl/episode_return_100": ret100,
            "rl/episodes": agg["episodes_mean"] * world,
            "rate/env_steps_per_s": (
                (self.env_steps - window.env_steps0)
                if self.attached
                else self.cfg.env.num_envs * self.n_actors * window.iterations
            )
            / elapsed,
            "rate/learner_steps_per_s": agg["learner_steps_per_s_mean"],
            "train/loss": agg["loss_mean"],
            "train/epsilon": self.agent.epsilon(self.env_steps),
            "train/policy_version": float(self.policy_version),
            "store/items": agg["items_max"],
            "store/occupancy": agg["items_max"] / capacity,
            "path/bytes_in": agg["bytes_in_mean"] * world,
            "path/bytes_out": agg["bytes_out_mean"] * world,
            "path/policy_age_max": agg["age_max_max"],
            "learner_steps": float(self.agent.steps),
            **store_metrics(agg, store, world),  # bytes per tier (mean over ranks), ...
            **link_metrics(agg, world),  # bytes the rounds sent by link class, all ranks
        }
        metrics.update(phase_metrics(agg))  # path/*_ms_*, the per-iteration breakdown
        for k in attached:  # attached actors: the ledger over every rank's ingress (attach/*)
            metrics[f"attach/{k.removeprefix('attached_')}"] = agg[f"{k}_mean"] * world
        self.logger.log(metrics, self.env_steps, window.histograms(ages))
        return {"return_100": ret100, **metrics}

    def close(self) -> None:
        """Export the trace (if configured), close the plane and the environments."""
        if self.cfg.plane.trace_dir and isinstance(self.plane, DataPlane):
            self.plane.export_trace(f"{self.cfg.plane.trace_dir}/trace_rank{self.rank}.json")
        self.plane.close()
        if self.env is not None:
            self.env.close()


def write_summary(path: str, summary: dict[str, object]) -> None:
    """Write the run's summary as JSON (atomically: a temporary file, then a rename)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=1, default=float)
    os.replace(tmp, path)
