"""``train.py experiment=grpo``: GRPO through the token plane, colocated and disaggregated, a few
global batches each (real torchrun, Hydra, gloo, W&B offline), its refusals, and the update the
plane feeds: two learners' accumulated micro-batches give the single-process step."""

from __future__ import annotations

import ast
import glob
import json
import math
import os

import numpy as np
import pytest
import torch
from dist_utils import ROOT, learners_and_attached, run_ranks
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from test_train import _torchrun
from wandb_reader import history

from conduit_dist.errors import ConfigError
from conduit_dist.rl.grpo import (
    VOCAB,
    GRPOConfig,
    make_prompts,
    sample_groups,
    split_micro_batches,
    to_token_batch,
)
from conduit_dist.rl.grpo_update import GRPOUpdate
from conduit_dist.rl.lm import LMConfig, TinyLM
from conduit_dist.train.config import TrainConfig, register, validate
from conduit_dist.train.grpo_trainer import GRPOTrainer
from conduit_dist.train.metrics import NullLogger

register()
STEPS = 12  # global batches of 8 groups x 16 responses


def _done(res) -> dict:
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    line = next(x for x in out.splitlines() if "done: {" in x)
    return ast.literal_eval(line.split("done: ", 1)[1])


def _rows(tmp_path) -> list[dict]:
    return [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def _check_rows(rows: list[dict], bound: int, steps: int = STEPS) -> None:
    """The first row is the held-out evaluation before any step; the last holds the one after
    the last step; every other row is a training window."""
    assert set(rows[0]) >= {"eval/exact", "eval/reward"} and rows[0]["env_steps"] == 0
    assert "train/policy_version" not in rows[0] and "eval/exact" in rows[-1]
    for r in (rows[0], rows[-1]):
        assert 0 <= r["eval/exact"] <= r["eval/reward"] <= 1
    rows = rows[1:]
    versions = [r["train/policy_version"] for r in rows]
    assert versions == sorted(versions) and versions[-1] == steps, versions
    for r in rows:
        assert math.isfinite(r["train/pg_loss"]) and math.isfinite(r["train/grad_norm"])
        assert 0 <= r["rl/reward"] <= 1 and r["rl/response_len"] >= 1
        assert 0 <= r["path/policy_age_max"] <= bound
        assert r["path/exposed_ms_mean"] >= 0 and r["path/hidden_ms_mean"] >= 0
        assert r["rate/gen_tokens_per_s"] > 0 and r["rate/train_tokens_per_s"] > 0


def steps_sent(rows: list[dict]) -> float:
    """The version a window's last publish had sent by its log (one behind the policy's)."""
    return rows[-1]["train/policy_version"] - 1


def test_colocated_two_ranks_streams_and_logs_to_wandb(tmp_path):
    res = _torchrun(
        tmp_path, "experiment=grpo", "logger=wandb", "logger.mode=offline",
        f"total_env_steps={STEPS * 128}", "logger.log_every=4",
    )  # fmt: skip
    done = _done(res)
    assert done["steps"] == STEPS and done["trained_samples"] == STEPS * 128
    assert done["dropped_stale"] == 0 and done["max_policy_age_seen"] <= 1
    assert 0 <= done["reward_first_100"] <= 1 and 0 <= done["reward_100"] <= 1
    rows = _rows(tmp_path)
    assert len(rows) == 1 + STEPS // 4
    _check_rows(rows, 1)
    assert done["eval_exact_first"] == rows[0]["eval/exact"]
    assert done["eval_exact_last"] == rows[-1]["eval/exact"]
    assert done["weights_ms_per_version"] == 0  # colocated: no weights move
    run = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    assert len(run) == 1, run
    keys = {k for row in history(glob.glob(os.path.join(run[0], "*.wandb"))[0]) for k in row}
    assert {"rl/reward", "path/policy_age_max", "rate/gen_tokens_per_s", "eval/exact"} <= keys


def test_disaggregated_one_learner_two_generators_keeps_the_age_bound(tmp_path):
    res = _torchrun(
        tmp_path, "experiment=grpo", "logger=none", "mode=disaggregated", "learner_ranks=[0]",
        f"total_env_steps={STEPS * 128}", "logger.log_every=4", nproc=3,
    )  # fmt: skip
    done = _done(res)
    assert done["steps"] == STEPS and done["dropped_stale"] == 0
    assert done["max_policy_age_seen"] <= 1
    rows = _rows(tmp_path)
    _check_rows(rows, 1)
    assert done["eval_exact_last"] == rows[-1]["eval/exact"]  # rank 0, the only learner
    # the weights went to the two generators every version, timed: a learner's pack plus the
    # round's transfer, and the bytes the generators received per second
    assert done["weights_ms_per_version"] > 0 and done["weights_gbps"] > 0
    assert rows[-1]["weights/version_sent"] >= steps_sent(rows) and rows[-1]["weights/gbps"] > 0


def test_learners_with_a_generator_attached_from_outside_the_job(tmp_path):
    """Two learner ranks open ingresses; a generator started after them (python train.py
    algo.grpo.role=generator) attaches, pulls each version and puts; both end cleanly."""
    gen_dir = tmp_path / "ingress"
    done, gdone = learners_and_attached(
        tmp_path,
        ["experiment=grpo", "logger=none", "mode=disaggregated", "algo.grpo.generators=attached",
         f"algo.grpo.attach_dir={gen_dir}", f"total_env_steps={4 * 128}", "logger.log_every=2",
         "algo.grpo.wait_s=90"],
        ["experiment=grpo", "algo.grpo.role=generator", f"algo.grpo.attach_dir={gen_dir}"],
    )  # fmt: skip
    assert done["steps"] == 4 and done["max_policy_age_seen"] <= 1
    assert done["trained_samples"] == 4 * 128
    assert gdone["groups"] >= 4 * 8 and gdone["versions_seen"] >= 2  # it pulled new weights
    assert not list(gen_dir.glob("ingress-rank*.json"))  # the learners closed their ingresses
    rows = [r for r in _rows(tmp_path) if "attach/acked" in r]  # the ledger, over both learners
    assert rows and rows[-1]["attach/acked"] >= 4 * 8 / 2 and rows[-1]["attach/lost"] == 0


def test_colocated_fetch_two_epochs_with_kl_and_age_zero(tmp_path):
    res = _torchrun(
        tmp_path, "experiment=grpo", "logger=none", "algo.grpo.stream=false",
        "algo.grpo.epochs=2", "algo.grpo.kl_coef=0.05", "algo.grpo.max_policy_age=0",
        f"total_env_steps={STEPS * 128}", "logger.log_every=4",
    )  # fmt: skip
    done = _done(res)  # total_env_steps counts each epoch's responses
    assert done["trained_samples"] == STEPS * 128 and done["steps"] == STEPS // 2
    assert done["max_policy_age_seen"] == 0
    rows = _rows(tmp_path)
    _check_rows(rows, 0, STEPS // 2)
    assert all(r["train/kl"] >= 0 for r in rows[1:])


def _compose(*overrides: str) -> TrainConfig:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        dcfg = compose("config", overrides=["experiment=grpo", "logger=none", *overrides])
    cfg = OmegaConf.to_object(dcfg)
    validate(cfg)
    return cfg


@pytest.mark.parametrize(
    "override, message",
    [
        ("plane.sampler=prioritized", r"plane.sampler: expected 'auto' with algo=grpo"),
        ("plane=simple", r"plane.kind: expected 'conduit' with algo=grpo"),
        ("plane.tiers=[[host,100]]", r"plane.tiers: expected None with algo=grpo"),
        ("checkpoint.dir=/tmp/x", r"checkpoint.dir: .*algo=.grpo. \(PPO and GRPO resume"),
        ("algo.grpo.gen_groups=17", r"algo.grpo.gen_groups: expected <= 16 .* got 17"),
        ("algo.grpo.group_size=1", r"algo.grpo.group_size: expected >= 2"),
        ("algo.grpo.d_model=30", r"algo.grpo.d_model: expected a multiple of n_heads=4"),
        ("plane.placement=round_robin", r"plane.placement: expected auto or local"),
        ("algo.grpo.eval_every=-1", r"algo.grpo.eval_every: expected >= 0, got -1"),
        ("algo.grpo.eval_prompts=0", r"algo.grpo.eval_prompts: expected >= 1, got 0"),
        ("algo.grpo.eval_prompts=999999", r"algo.grpo.eval_prompts: .* do not fit"),
    ],
)
def test_grpo_refuses_settings_it_cannot_honour(override, message):
    """Refused before anything is built (no process group or plane)."""
    with pytest.raises(ConfigError, match=message):
        GRPOTrainer(_compose(override), NullLogger())


def test_the_default_experiment_with_algo_grpo_is_refused_with_the_way_out():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        dcfg = compose("config", overrides=["algo=grpo", "logger=none"])
    cfg = OmegaConf.to_object(dcfg)
    with pytest.raises(ConfigError, match=r"use experiment=grpo"):
        GRPOTrainer(cfg, NullLogger())


def _batch(seed: int):
    cfg = GRPOConfig(group_size=4, prompts_per_step=6, max_new=6, max_digits=4)
    torch.manual_seed(0)
    policy = TinyLM(LMConfig(vocab=VOCAB, d_model=32, max_len=11))
    groups = sample_groups(
        policy, make_prompts(6, np.random.default_rng(seed), 4), 4, 6, torch.Generator()
    )
    batch, lengths = to_token_batch(groups)
    # an untrained policy's rewards are mostly 0 (advantages 0): give every response token one
    advantage = torch.randn(len(batch["advantage"]), generator=torch.Generator().manual_seed(seed))
    batch["advantage"] = advantage * batch["loss_mask"]
    return cfg, policy, (batch, lengths)


def _learner_step(rank, world):  # pragma: no cover - runs in a spawned rank
    import torch.distributed as dist

    cfg, policy, (batch, lengths) = _batch(1)
    mine = torch.arange(len(lengths))[rank * 12 : (rank + 1) * 12]  # 3 whole groups each
    update = GRPOUpdate(policy, cfg, dist.group.WORLD)
    update.opt = torch.optim.SGD(update.params, lr=0.1)  # unlike Adam, sensitive to the scale
    for fields, cu, width in split_micro_batches(batch, lengths, 20, mine):
        update.accumulate(fields, cu, width)
    update.step()
    return [p.detach().numpy().copy() for p in policy.parameters()]  # no shared memory


def test_two_learners_take_the_single_process_step():
    """The gradient is the token mean over the global batch whatever the split: two learners
    with three groups each, in micro-batches of at most 20 tokens, end with the parameters of
    one process that took the six groups in one micro-batch (SGD, so a gradient off by any
    factor would show)."""
    got = run_ranks(_learner_step, 2)
    cfg, policy, (batch, lengths) = _batch(1)
    update = GRPOUpdate(policy, cfg)
    update.opt = torch.optim.SGD(update.params, lr=0.1)
    for fields, cu, width in split_micro_batches(batch, lengths, 10_000):
        update.accumulate(fields, cu, width)
    update.step()
    for rank in (0, 1):
        for a, b in zip(got[rank], policy.parameters(), strict=True):
            torch.testing.assert_close(torch.from_numpy(a), b.detach(), rtol=1e-5, atol=1e-6)


def test_three_generators_at_age_zero_stop_on_time_and_log_the_last_window(tmp_path):
    """A chunk of 2 groups does not fit a window of 8 // 3 groups at max_policy_age=0: the
    generators take what the window allows (no stall); the run stops on max_minutes and logs
    that window although log_every was not reached."""
    res = _torchrun(
        tmp_path, "experiment=grpo", "logger=none", "mode=disaggregated", "learner_ranks=[0]",
        "algo.grpo.max_policy_age=0", "algo.grpo.max_minutes=0.1", "logger.log_every=100000",
        nproc=4,
    )  # fmt: skip
    done = _done(res)
    assert 1 <= done["steps"] < 100000 and done["max_policy_age_seen"] == 0
    assert done["dropped_stale"] == 0 and done["evicted_groups"] == 0
    rows = _rows(tmp_path)
    assert len(rows) == 2 and rows[1]["train/policy_version"] == done["steps"]
    assert rows[1]["eval/exact"] == done["eval_exact_last"]
