"""The GRPO loop behind ``train.py experiment=grpo``: a small causal LM learns to reverse digit
strings, its experience moving through a ``cd.TokenPlane`` (docs/grpo.md).

Producers generate prompt groups (``algo.grpo.gen_groups`` at a time) with the newest weights
they hold, score them, and ``put`` them tagged with their policy version, after ``reserve``
allowed it: a producer runs at most ``max_policy_age`` versions ahead of the learners, so
nothing is ever dropped for age. Learners ``stream`` each global batch of ``prompts_per_step``
whole groups as token-balanced micro-batches as soon as groups complete, accumulate each
micro-batch's gradient (``rl/grpo_update.py``), take one optimiser step per global batch
(per epoch) and publish the next version.

- ``mode=colocated``: every rank generates and learns. Generation runs inside the learner's
  ``stream`` (its ``produce`` callback, before each round), never asking for more than
  ``allowance()``; the learners average gradients over the default group.
- ``mode=disaggregated``: ``learner_ranks`` learn, the other ranks generate. A generator
  ``reserve``s (pulling the newest weights, and waiting in rounds while it is a full window
  ahead), generates, ``put``s and takes part in one round (``flush``); its generation runs
  while the learner trains on the previous piece.

Every consumed sequence's policy age (the learner's version minus the oldest token's) is
checked against the bound (the plane also refuses to deliver older ones).

Learning is judged on held-out prompts (``rl/grpo_eval.py``): training never draws them; the
learners answer them greedily before the first step, every ``eval_every`` global batches and
after the last (``eval/exact``, ``eval/reward``; ``eval_exact_first``/``_last`` in the summary).
"""

from __future__ import annotations

import copy
import math
import time
from collections import deque
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from conduit_dist.errors import ConfigError, StaleDataError
from conduit_dist.plane.options import TransportConfig
from conduit_dist.rl.grpo import VOCAB, sample_groups, to_token_batch, token_spec
from conduit_dist.rl.grpo_eval import PromptSplit, greedy_rewards
from conduit_dist.rl.grpo_update import GRPOUpdate
from conduit_dist.rl.lm import LMConfig, TinyLM
from conduit_dist.tokens.plane import TokenPlane
from conduit_dist.train import setup
from conduit_dist.train.config import TrainConfig
from conduit_dist.train.grpo_config import check_grpo
from conduit_dist.train.grpo_window import (
    Window,
    aggregate_learners,
    per_learner_step,
    summary_values,
    weights_summary,
)
from conduit_dist.train.metrics import Logger, aggregate


class GRPOTrainer:
    """Runs GRPO with token experience flowing through a :class:`TokenPlane`.

    Args:
        cfg: the validated run config (``algo.name == "grpo"``).
        logger: where rank 0 logs.
        device: the resolved device (``setup.device``; ``None``: resolved here): the policy
            samples and learns there; experience is scored and stored on the host.

    Raises:
        ConfigError: on settings GRPO cannot honour (``train/grpo_config.py``), with
            ``learner_ranks`` not holding rank 0 (the run's logger lives on rank 0 and logs
            the learners' metrics), or ``eval_prompts`` too many to hold out.
    """

    DONE_KEYS = (
        "reward_first_100", "reward_100", "wall_s", "max_policy_age_seen", "dropped_stale",
        "trained_samples", "steps", "evicted_groups", "exposed_ms_per_step", "hidden_ms_per_step",
        "eval_exact_first", "eval_exact_last", "weights_ms_per_version", "weights_gbps",
    )  # fmt: skip

    def __init__(
        self, cfg: TrainConfig, logger: Logger, device: torch.device | None = None
    ) -> None:
        g = self.g = cfg.algo.grpo
        self.cfg, self.logger = cfg, logger
        self.device = device if device is not None else setup.device(cfg)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.learners = setup.learner_ranks(cfg, self.world)
        check_grpo(cfg, self.world, self.learners)
        if 0 not in self.learners:
            raise ConfigError(
                f"learner_ranks: expected rank 0 among them with algo=grpo (rank 0 logs the "
                f"learners' metrics), got {list(cfg.learner_ranks)}"
            )
        colocated = cfg.mode == "colocated"
        self.attached = g.generators == "attached"  # generators outside the job (attach)
        self.producers = [r for r in range(self.world) if colocated or r not in self.learners]
        self.is_learner, self.is_producer = self.rank in self.learners, self.rank in self.producers
        self.gcfg = g.to_config(cfg.algo.lr, cfg.algo.max_grad_norm, cfg.seed)
        try:  # the same held-out set on every rank: training prompts are drawn around it
            self.split = PromptSplit(g.eval_prompts, g.max_digits, g.eval_seed)
        except ValueError as e:
            raise ConfigError(f"algo.grpo.eval_prompts: {e}") from None
        lm = LMConfig(VOCAB, g.d_model, g.n_layers, g.n_heads, g.max_digits + 1 + g.max_new)
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        self.policy = TinyLM(lm).to(self.device)
        group = None
        if len(self.learners) > 1:  # collective: every rank calls new_group
            whole = len(self.learners) == self.world
            timeout = timedelta(seconds=cfg.plane.timeout_s)  # as the default group's
            group = dist.group.WORLD if whole else dist.new_group(self.learners, timeout=timeout)
        self.group = group
        self.update = None
        if self.is_learner:
            ref = copy.deepcopy(self.policy).requires_grad_(False) if g.kl_coef > 0 else None
            self.update = GRPOUpdate(self.policy, self.gcfg, group, ref)
        self.rng = np.random.default_rng([cfg.seed, self.rank])
        self.gen = torch.Generator(device=self.device).manual_seed(cfg.seed * 7919 + self.rank)
        seqs = (g.max_policy_age + 2) * g.prompts_per_step * g.group_size  # room for a window
        pc = cfg.plane
        self.plane = TokenPlane(
            token_spec(self.gcfg, {"gen_ms": ((), torch.float32)}),
            seqs,
            seqs * lm.max_len,
            learner_ranks=self.learners,
            # attached generators: every rank's shard takes their puts, none paced by rank
            producer_ranks=self.learners if self.attached else self.producers,
            max_policy_age=g.max_policy_age,
            groups_per_batch=None if self.attached else g.prompts_per_step,
            seed=cfg.seed,
            device=self.device,
            transport=TransportConfig(
                pc.timeout_s,
                pc.strategy,
                setup.bandwidth(cfg),
                pc.bandwidth_cache,
                shared_memory=pc.shared_memory,
                weights_bucket_mb=pc.weights_bucket_mb,
            ),
        )
        if self.attached:  # every rank an ingress: generators attach to g.attach_dir
            self.plane.open_ingress(g.attach_dir, groups_per_version=g.prompts_per_step)
        # the next global batch's first round launched at the first backward after a take
        # (TokenPlane.attach): plane.schedule overlap or auto; sync: rounds inside stream/fetch
        self.overlap = self.is_learner and pc.schedule != "sync"
        if self.overlap:  # the last module of the loss's path (packed_logprobs calls
            self.plane.attach(self.policy.ln_f)  # TinyLM.hidden, not forward: no hook there)
        self.version = self.steps = self.trained = self.next_gid = 0
        # each producer's share of "100 responses" (attached generators report their own)
        k = math.ceil(100 / max(len(self.producers), 1))
        self.first: list[float] = []  # the first k rewards this producer scored
        self.last: deque[float] = deque(maxlen=k)
        self.k = k
        self.gen_s = self.gen_tokens = 0.0
        self.produce_s = 0.0  # generation inside the current stream (colocated)
        self.exposed_s = self.hidden_s = 0.0  # the plane's measured split, all steps so far
        self.pack_s = 0.0  # publish_weights calls (a learner packing its part)
        self.max_age = 0
        self.eval_first = self.eval_last = {"exact": 0.0, "reward": 0.0}  # learners' figures
        # this learner's share of the last 100 consumed rewards (the target_return check)
        self.recent: deque[float] = deque(maxlen=math.ceil(100 / len(self.learners)))

    # ------------------------------------------------------------------ producers

    def _generate(self, n: int) -> bool:
        """Reserve, generate, score and put ``n`` groups; False once the plane was closed."""
        ids = [self.rank * 1_000_000_000 + self.next_gid + i for i in range(n)]
        pull = None if self.is_learner else self.policy
        version = self.plane.reserve(ids, model=pull)
        if version is None:
            return False
        self.next_gid += n
        t0 = time.perf_counter()
        prompts = self.split.train(n, self.rng)
        groups = sample_groups(self.policy, prompts, self.g.group_size, self.g.max_new, self.gen)
        batch, lengths = to_token_batch(groups, ids, self.g.adv_eps)
        dt = time.perf_counter() - t0
        batch["gen_ms"] = torch.full((len(lengths),), dt * 1e3 / len(lengths))
        self.plane.put(batch, lengths, version=version)
        rewards = batch["reward"].tolist()
        self.first.extend(rewards[: self.k - len(self.first)])
        self.last.extend(rewards)
        self.gen_s += dt
        self.gen_tokens += float(batch["loss_mask"].sum())
        return True

    def _produce(self) -> None:
        """Colocated: generate before a round, within the allowance (never waits)."""
        n = min(self.g.gen_groups, self.plane.allowance() or 0)
        if n:
            t0 = time.perf_counter()
            self._generate(n)
            self.produce_s += time.perf_counter() - t0

    def _produce_ahead(self) -> None:
        """Colocated with rounds launched at the backward: generate the next global batch's
        share now, with the current policy (what pacing allows: one version ahead), so the
        round the coming backward launches finds it complete and the next step waits for
        nothing."""
        while True:
            n = min(self.g.gen_groups, self.plane.allowance() or 0)
            if not n:
                return
            t0 = time.perf_counter()
            self._generate(n)
            self.produce_s += time.perf_counter() - t0

    def _generator_loop(self) -> None:
        """Disaggregated generators: reserve, generate, put, one round; until the learners
        close the plane. A chunk is at most the allowance; with none left, at most the
        producer's share per version (granted at the next version: a chunk the window can
        never hold would stall the learners)."""
        while True:
            left = self.plane.allowance() or 0
            n = min(self.g.gen_groups, left if left else self.plane.share)
            if not (self._generate(n) and self.plane.flush()):
                return

    # ------------------------------------------------------------------ learners

    def run(self) -> dict[str, object]:
        """Train until ``total_env_steps`` responses, ``algo.grpo.max_minutes`` or the target
        reward; returns the summary (collective: every rank calls it)."""
        start = time.perf_counter()
        if self.is_learner:
            self._learner_loop(start)
        else:
            self._generator_loop()
        self.plane.close()  # learners: the closing round; generators: already closed
        wall = time.perf_counter() - start
        agg = aggregate(summary_values(self), self.cfg.plane.timeout_s)
        first, last = agg["first_sum_mean"], agg["last_sum_mean"]
        return {
            # greedy exact match on the held-out prompts before the first step and after the
            # last (the learners' figure; other ranks add 0)
            "eval_exact_first": agg["eval_exact_first_max"],
            "eval_exact_last": agg["eval_exact_last_max"],
            "eval_reward_first": agg["eval_reward_first_max"],
            "eval_reward_last": agg["eval_reward_last_max"],
            "reward_first_100": first / max(agg["first_n_mean"], 1e-9),
            "reward_100": last / max(agg["last_n_mean"], 1e-9),
            "wall_s": round(wall, 1),
            "max_policy_age_seen": int(agg["max_age_max"]),
            "dropped_stale": round(agg["stale_evicted_mean"] * self.world),
            "evicted_groups": round(agg["evicted_groups_mean"] * self.world),
            "trained_samples": int(agg["trained_max"]),
            "steps": int(agg["steps_max"]),
            "gen_tokens_per_s": agg["gen_tokens_mean"] * self.world / wall,
            # a learner's wait for the plane per global batch, and what ran behind its
            # backward instead (TokenPlane.last_take, measured; means over the learners)
            "exposed_ms_per_step": per_learner_step(agg, "exposed_s", self),
            "hidden_ms_per_step": per_learner_step(agg, "hidden_s", self),
            # weights, disaggregated: per version, a learner's pack plus the round's transfer
            # (the slowest rank's mean), and what the generators received per second
            **weights_summary(agg),
        }

    def _learner_loop(self, start: float) -> None:
        g, cfg = self.g, self.cfg
        per_step = g.prompts_per_step * g.group_size * g.epochs  # responses trained per step
        total = math.ceil(cfg.total_env_steps / per_step)
        window = Window()
        self.eval_first = self.eval_last = self._evaluate()
        self.logger.log(_eval_metrics(self.eval_first), 0)
        while self.steps < total:
            self._step(window)
            elapsed = time.perf_counter() - start
            stop = [float(g.max_minutes > 0 and elapsed > 60 * g.max_minutes)]
            reached = self._reward_100(stop)
            last = stop[0] > 0 or reached or self.steps == total
            ev = {}
            if last or (g.eval_every and self.steps % g.eval_every == 0):
                self.eval_last = self._evaluate()
                ev = _eval_metrics(self.eval_last)
            if self.steps % cfg.logger.log_every == 0 or last:
                self._log(window, ev)
                window = Window()
            elif ev:
                self.logger.log(ev, self.trained)
            if stop[0] > 0 or reached:
                break

    def _evaluate(self) -> dict[str, float]:
        """Greedy answers to this learner's share of the held-out prompts, totalled over the
        learners (a collective of the learners): ``exact`` and ``reward`` over all of them."""
        share = self.split.heldout[self.learners.index(self.rank) :: len(self.learners)]
        r = greedy_rewards(self.policy, share, self.g.max_new)
        vals = [float((r == 1).sum()), float(r.sum()), float(len(r))]
        if self.group is not None:
            vals = aggregate_learners(vals, self.group, op="sum")
        return {"exact": vals[0] / vals[2], "reward": vals[1] / vals[2]}

    def _step(self, window: Window) -> None:
        g = self.g
        self.produce_s = 0.0
        produce = self._produce if self.is_producer else None
        t0 = time.perf_counter()
        taken = (
            self.plane.stream(g.prompts_per_step, g.token_budget, produce=produce, wait_s=g.wait_s)
            if g.stream
            else iter(self.plane.fetch(g.prompts_per_step, g.token_budget, produce=produce))
        )
        kept = []
        ahead = self.overlap and self.is_producer
        for i, mb in enumerate(taken):
            if i == 0 and ahead:  # before the first backward: the next batch's groups
                self._produce_ahead()
            window.consume(mb, self.version)
            self.update.accumulate(mb.fields, mb.cu_seqlens, mb.max_seqlen)
            if g.epochs > 1:
                kept.append(mb)
        take = self.plane.last_take  # measured by the plane: exposed, and hidden at backward
        stats = self.update.step()
        for _ in range(g.epochs - 1):
            for mb in kept:
                self.update.accumulate(mb.fields, mb.cu_seqlens, mb.max_seqlen)
            stats = self.update.step()
        colocated = self.cfg.mode == "colocated"
        t_pub = time.perf_counter()
        self.version = self.plane.publish_weights(None if colocated else self.policy)
        self.pack_s += time.perf_counter() - t_pub  # the learner's part packed (a snapshot)
        self.steps += 1
        # attached generators: their number is not the job's; the batch's generation time
        # counts as one generator's
        age, rewards = window.end_step(
            stats, take, self.produce_s, max(len(self.producers), 1), g.group_size
        )
        self.exposed_s += take.exposed_ms / 1e3
        self.hidden_s += take.hidden_ms / 1e3
        self.recent.extend(rewards)
        if age > g.max_policy_age:  # the plane refuses older ones; checked here on every row
            raise StaleDataError(
                f"GRPO step {self.steps}: a consumed token's policy age {age} exceeds "
                f"algo.grpo.max_policy_age={g.max_policy_age}"
            )
        self.max_age = max(self.max_age, age)
        self.trained = self.steps * g.prompts_per_step * g.group_size * g.epochs
        window.step_ms.append((time.perf_counter() - t0) * 1e3)

    def _reward_100(self, stop: list[float]) -> bool:
        """Whether the learners' last-100 consumed reward reached ``target_return``; also
        agrees on ``stop`` (any learner out of time) in the same collective."""
        target = self.cfg.target_return
        vals = [*stop, sum(self.recent), len(self.recent)]
        if self.group is not None:
            vals = aggregate_learners(vals, self.group, op="sum")
        stop[0] = vals[0]
        return target is not None and vals[2] > 0 and vals[1] / vals[2] >= target

    def _log(self, window: Window, extra: dict[str, float]) -> None:
        metrics = {
            **window.metrics(self),
            **extra,
            **self._ledger_metrics(),
            **self._weights_metrics(),
        }
        self.logger.log(metrics, int(metrics["train/trained_samples"]), window.histograms())

    def _weights_metrics(self) -> dict[str, float]:
        """This learner's side of the last weights transfer (``weights/*``; none before one):
        its version, milliseconds, the mean pack per publish, and GB/s of what it moved over
        its pack and transfer together (through ``/dev/shm`` the pack is the move)."""
        last = self.plane.weights.last
        if not last.version:
            return {}
        pack_s = self.pack_s / max(self.steps, 1)
        moved = last.sent + last.received
        return {
            "weights/version_sent": float(last.version),
            "weights/transfer_ms": last.seconds * 1e3,
            "weights/gbps": moved / max(pack_s + last.seconds, 1e-9) / 1e9,
            "weights/pack_ms": pack_s * 1e3,
        }

    def _ledger_metrics(self) -> dict[str, float]:
        """Attached generators: the ledger's totals over every learner's ingress (``attach/*``:
        puts acknowledged, groups delivered and dropped, puts lost, generators live; a
        collective of the learners); nothing otherwise."""
        if not self.attached:
            return {}
        totals = self.plane.ingress.totals()
        keys = sorted(totals)
        vals = [float(totals[k]) for k in keys]
        if self.group is not None:
            vals = aggregate_learners(vals, self.group, op="sum")
        return {f"attach/{k.removeprefix('attached_')}": v for k, v in zip(keys, vals)}

    def close(self) -> None:
        """Release the plane: a no-op after ``run`` (which closed it); after a failure an
        abort without a closing round, so the original error is not masked by a peer's
        timeout."""
        if not self.plane.closed:
            self.plane.abort()


def _eval_metrics(ev: dict[str, float]) -> dict[str, float]:
    """An evaluation's logged metrics."""
    return {"eval/exact": ev["exact"], "eval/reward": ev["reward"]}
