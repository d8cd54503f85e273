"""PPO's plane from the ``plane`` group (``setup.build_plane``, as DQN's): storage tiers,
placement and trace are honoured; what PPO cannot honour is refused at construction, naming the
setting and the value received."""

from __future__ import annotations

import pytest
from dist_utils import ROOT, run_ranks
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from conduit_dist.errors import ConfigError
from conduit_dist.train.config import TrainConfig, register, validate
from conduit_dist.train.metrics import NullLogger
from conduit_dist.train.ppo_trainer import PPOTrainer

register()


def _compose(*overrides: str) -> TrainConfig:
    """``train.py experiment=cartpole_ppo logger=none *overrides``'s validated config."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        dcfg = compose("config", overrides=["experiment=cartpole_ppo", "logger=none", *overrides])
    cfg = OmegaConf.to_object(dcfg)
    validate(cfg)
    return cfg


@pytest.mark.parametrize(
    "override, message",
    [
        pytest.param(
            "plane.sampler=uniform",
            r"plane.sampler: PPO reads each rollout algo.ppo.epochs=4 times and then drops it, "
            r"which is WithoutReplacement\(algo.ppo.epochs, algo.ppo.shuffle\); expected 'auto' "
            r"\(or 'without_replacement'\), got 'uniform'",
            id="sampler-uniform",
        ),
        pytest.param(
            "plane.sampler=prioritized",
            r"plane.sampler: .*got 'prioritized'",
            id="sampler-prioritized",
        ),
        pytest.param(
            "plane.early_start=true",
            r"plane.early_start: PPO's minibatch rounds already run behind the previous "
            r"backward .*DQN's algo.grad_sync=round path; expected auto or false, got true",
            id="early_start",
        ),
        pytest.param(
            "plane=simple",
            r"plane.kind: PPO needs the sharded data plane \('conduit'\).*got 'simple'",
            id="kind-simple",
        ),
    ],
)
def test_ppo_refuses_plane_settings_it_cannot_honour(override, message):
    """Refused before anything is built (no process group, env or plane needed)."""
    cfg = _compose(override)
    with pytest.raises(ConfigError, match=message):
        PPOTrainer(cfg, NullLogger())


def _ppo_run(rank, world, cfg):  # pragma: no cover - runs in a spawned rank
    trainer = PPOTrainer(cfg, NullLogger())
    try:
        summary = trainer.run()
        plane = trainer.plane
        stats = plane.store_stats()
        return {
            "tiers": [(t["kind"], t["bandwidth_source"]) for t in stats["tiers"]],
            "demotions": stats["demotions"],
            "placement": plane.placement.name,
            "sampler": (type(plane.sampler).__name__, plane.sampler.epochs),
            "iterations": summary["iterations"],
            "max_age": summary["max_policy_age_seen"],
        }
    finally:
        trainer.close()


def test_ppo_stores_rollouts_in_the_configured_tiers(tmp_path):
    """One world-size-1 rank, two 64-item rollouts into a 32-item host tier over a disk tier:
    items are demoted to disk, the placement and trace asked for are used, and
    ``plane.prioritized`` (meaningless without ``plane.sampler=prioritized``) is no error."""
    disk, trace = tmp_path / "disk", tmp_path / "trace"
    cfg = _compose(
        "total_env_steps=128",
        "env.num_envs=2",
        "algo.ppo.num_steps=32",
        "plane.capacity_per_rank=96",
        "plane.tiers=[[host,32],[disk,64]]",
        f"plane.disk_dir={disk}",
        "+plane.tier_gbps={host:[5.0,5.0],disk:[1.0,1.0]}",
        "plane.placement=round_robin",
        "plane.calibrate=false",
        "plane.prioritized.alpha=0.9",
        f"plane.trace_dir={trace}",
    )
    got = run_ranks(_ppo_run, 1, cfg, timeout_s=120)[0]
    assert got["tiers"] == [("host", "config"), ("disk", "config")], got
    assert got["demotions"] > 0, got
    assert got["placement"] == "round_robin", got
    assert got["sampler"] == ("WithoutReplacement", 4), got
    assert got["iterations"] == 2 and got["max_age"] == 0, got
    assert (trace / "trace_rank0.json").is_file()
    assert not list(disk.iterdir())  # disk tier files removed on close
