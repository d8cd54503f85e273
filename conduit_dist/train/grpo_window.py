"""What a GRPO learner measures between two logs, and the values the run's summary aggregates.

Per consumed micro-batch the learner keeps its device tensors (rewards, policy ages, response
tokens, the producers' generation time); at the end of a global batch they are read to the
host once. At a log the learners' values are summed (and maxed) over the learners' group, so
the logged figures cover every learner whatever their number.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from conduit_dist.errors import RoundError
from conduit_dist.tokens.ahead import TakeTiming
from conduit_dist.tokens.batch import MicroBatch

if TYPE_CHECKING:
    from conduit_dist.train.grpo_trainer import GRPOTrainer

SUMS = (
    "reward_sum", "sequences", "exact", "resp_tokens", "tokens", "exposed_s", "hidden_s",
    "generate_s", "age_sum", "pg", "clipfrac", "ratio", "kl", "grad_norm", "steps", "step_s",
)  # fmt: skip


def aggregate_learners(values: list[float], group, op: str = "sum") -> list[float]:
    """Sum or max of ``values`` over the learners (one ``all_reduce``, a collective of the
    learners, under the group's timeout: ``plane.timeout_s``).

    Args:
        values: the same number of values on every learner.
        group: the learners' process group.
        op: ``"sum"`` or ``"max"``.

    Returns:
        The reduced values.
    """
    t = torch.tensor(values, dtype=torch.float64)
    reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
    dist.all_reduce(t, reduce_op, group=group)
    return t.tolist()


class Window:
    """A learner's measurements between two logs."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.v = dict.fromkeys(SUMS, 0.0)
        self.age_max = 0
        self.ages: list[int] = []
        self.step_ms: list[float] = []
        self._mbs: list[tuple[torch.Tensor, ...]] = []  # the current step's micro-batches

    def consume(self, mb: MicroBatch, version: int) -> None:
        """Keep a delivered micro-batch's figures (no host read)."""
        age = version - mb["_version"]
        resp = mb["loss_mask"].sum()
        tokens = torch.tensor(mb.fields["tokens"].shape[0])  # no device read
        self._mbs.append((mb["reward"], age, resp, mb["gen_ms"].sum(), tokens, mb["group"]))

    def end_step(
        self,
        stats: dict[str, float],
        take: TakeTiming,
        produce_s: float,
        producers: int,
        group_size: int,
    ) -> tuple[int, list[float]]:
        """Close a global batch: one host read of its micro-batches' figures.

        Args:
            stats: the optimiser step's stats (``GRPOUpdate.step``).
            take: the plane's measured split of the batch's rounds (``TokenPlane.last_take``):
                the learner's wait for them (its own generation excluded), and the time a round
                launched at the previous backward ran before the learner asked.
            produce_s: its own generation inside the stream (colocated), else 0.
            producers: the number of producers (the generation time of the batch, summed over
                the sequences, divided by it is the producers' wall time in parallel).
            group_size: sequences per group (every delivered group is checked whole).

        Returns:
            The oldest policy age among the batch's sequences on this learner, and their
            rewards.

        Raises:
            RoundError: if a micro-batch holds part of a group.
        """
        rewards = torch.cat([m[0] for m in self._mbs]).cpu()
        ages = torch.cat([m[1] for m in self._mbs]).cpu()
        small = torch.stack([torch.stack([m[2].double(), m[3].double()]) for m in self._mbs])
        resp, gen_ms = small.sum(0).cpu().tolist()
        tokens = sum(int(m[4]) for m in self._mbs)
        for m in self._mbs:  # a group is delivered whole, inside one micro-batch
            _, counts = torch.unique(m[5].cpu(), return_counts=True)
            if bool((counts != group_size).any()):
                raise RoundError(
                    f"a micro-batch holds groups of {sorted(set(counts.tolist()))} sequences, "
                    f"expected every group whole ({group_size}): a bug in the token plane",
                    round=-1,
                )
        self._mbs = []
        v = self.v
        v["reward_sum"] += float(rewards.sum())
        v["sequences"] += len(rewards)
        v["exact"] += float((rewards == 1).sum())
        v["resp_tokens"] += resp
        v["tokens"] += tokens
        v["exposed_s"] += take.exposed_ms / 1e3
        v["hidden_s"] += take.hidden_ms / 1e3
        # colocated: this rank's own generation inside the stream; disaggregated: the
        # producers' generation of this learner's share, in parallel over the producers
        # (summed over the learners at a log: the batch's)
        v["generate_s"] += produce_s if produce_s > 0 else gen_ms / 1e3 / producers
        v["age_sum"] += float(ages.sum())
        for k in ("pg", "clipfrac", "ratio", "kl", "grad_norm"):
            v[k] += stats[k]
        v["steps"] += 1
        age = int(ages.max()) if len(ages) else 0
        self.ages.extend(ages.tolist())
        self.age_max = max(self.age_max, age)
        return age, rewards.tolist()

    def metrics(self, tr: GRPOTrainer) -> dict[str, float]:
        """The window's figures over every learner (a collective of the learners)."""
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        v = self.v
        v["step_s"] = sum(self.step_ms) / 1e3
        vals = [v[k] for k in SUMS]
        age_max = float(self.age_max)
        if tr.group is not None:
            vals = aggregate_learners(vals, tr.group, "sum")
            age_max = aggregate_learners([age_max], tr.group, "max")[0]
        s = dict(zip(SUMS, vals, strict=True))
        n_l = len(tr.learners)
        steps = max(s["steps"] / n_l, 1.0)  # global batches in the window
        seqs = max(s["sequences"], 1.0)
        per_step_ms = 1e3 / steps / n_l  # a learner's mean per global batch
        exposed = s["exposed_s"] * per_step_ms  # measured by the plane (last_take)
        hidden = s["hidden_s"] * per_step_ms  # a launched round's time before it was asked for
        if tr.cfg.mode == "colocated":  # each learner generated its own share, on its thread
            generate = s["generate_s"] * per_step_ms
        else:  # the learners' shares add up to the batch
            generate = s["generate_s"] * 1e3 / steps
        return {
            "rl/reward": s["reward_sum"] / seqs,
            "rl/exact": s["exact"] / seqs,
            "rl/response_len": s["resp_tokens"] / seqs,
            "rate/gen_tokens_per_s": s["resp_tokens"] / elapsed,
            "rate/train_tokens_per_s": s["tokens"] * tr.g.epochs / elapsed,
            "rate/samples_per_s": s["sequences"] / elapsed,
            "train/pg_loss": s["pg"] / steps / n_l,
            "train/clipfrac": s["clipfrac"] / steps / n_l,
            "train/ratio": s["ratio"] / steps / n_l,
            "train/kl": s["kl"] / steps / n_l,
            "train/grad_norm": s["grad_norm"] / steps / n_l,
            "train/policy_version": float(tr.version),
            "train/trained_samples": float(tr.trained),
            "path/exposed_ms_mean": exposed,
            "path/hidden_ms_mean": hidden,
            "path/generate_ms_mean": generate,
            "path/step_ms_mean": s["step_s"] * per_step_ms,
            "path/policy_age_mean": s["age_sum"] / seqs,
            "path/policy_age_max": age_max,
        }

    def histograms(self) -> dict[str, list[float]]:
        """This learner's per-sequence policy ages and per-step times in the window."""
        return {"path/policy_age_hist": self.ages, "path/step_ms_hist": self.step_ms}


def summary_values(tr: GRPOTrainer) -> dict[str, float]:
    """Every rank's values for the run's summary.

    Args:
        tr: the trainer, after its loop.

    Returns:
        The same keys on every rank (producers' rewards and generation, learners' ages,
        counts and held-out evaluations (0 on other ranks), this shard's evictions).
    """
    st = tr.plane.stats()
    return {
        "first_sum": sum(tr.first), "first_n": len(tr.first),
        "last_sum": sum(tr.last), "last_n": len(tr.last),
        "gen_s": tr.gen_s, "gen_tokens": tr.gen_tokens,
        "max_age": tr.max_age, "trained": tr.trained, "steps": tr.steps,
        "stale_evicted": st["stale_evicted"], "evicted_groups": st["evicted_groups"],
        "exposed_s": tr.exposed_s, "hidden_s": tr.hidden_s,
        "eval_exact_first": tr.eval_first["exact"], "eval_exact_last": tr.eval_last["exact"],
        "eval_reward_first": tr.eval_first["reward"], "eval_reward_last": tr.eval_last["reward"],
        **_weights_values(tr),
    }  # fmt: skip


def _weights_values(tr: GRPOTrainer) -> dict[str, float]:
    """This rank's weights figures: its packs (learners), its transfers, what it received."""
    tot = tr.plane.weights.totals
    return {
        "wpack_s": tr.pack_s if tr.is_learner else 0.0,
        "wversions": float(tr.steps if tr.is_learner else 0),
        "wxfer_s": tot["seconds"], "wxfers": float(tot["transfers"]),
        "wrecv_bytes": float(tot["received"]),
        "wrecv_s": tot["seconds"] if tot["received"] else 0.0,
    }  # fmt: skip


def weights_summary(agg: dict[str, float]) -> dict[str, float]:
    """The done line's weights figures from :func:`summary_values` aggregated over the ranks:
    ``weights_ms_per_version`` (a learner's mean pack plus the slowest rank's mean transfer;
    0 where no weights moved) and ``weights_gbps`` (bytes the generators received over their
    transfer seconds)."""
    versions, transfers = agg["wversions_max"], agg["wxfers_max"]
    if not transfers:
        return {"weights_ms_per_version": 0.0, "weights_gbps": 0.0}
    pack = agg["wpack_s_max"] / max(versions, 1.0)
    xfer = agg["wxfer_s_max"] / transfers
    gbps = agg["wrecv_bytes_mean"] / max(agg["wrecv_s_mean"], 1e-9) / 1e9
    return {
        "weights_ms_per_version": round((pack + xfer) * 1e3, 3),
        "weights_gbps": round(gbps, 3),
    }


def per_learner_step(agg: dict[str, float], key: str, tr: GRPOTrainer) -> float:
    """Milliseconds per global batch of a learner's ``key`` (seconds summed over its steps),
    from :func:`summary_values` aggregated over every rank (``<key>_mean``: producers add 0).

    Args:
        agg: the aggregated summary values.
        key: ``exposed_s`` or ``hidden_s``.
        tr: the trainer.

    Returns:
        The mean over the learners, per step.
    """
    steps = max(agg["steps_max"], 1.0)
    return round(agg[f"{key}_mean"] * tr.world / len(tr.learners) / steps * 1e3, 3)
