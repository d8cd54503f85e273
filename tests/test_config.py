"""Config values resolve through the registry's tables: an unknown value is an error naming it."""

from __future__ import annotations

import pytest

from conduit_dist import registry
from conduit_dist.errors import ConfigError
from conduit_dist.sampling import WithoutReplacement
from conduit_dist.train import setup
from conduit_dist.train.config import AlgoConfig, PlaneConfig, PPOConfig, TrainConfig, validate


@pytest.mark.parametrize(
    "cfg, message",
    [
        (
            TrainConfig(algo=AlgoConfig(name="sac")),
            r"algo.name: expected one of \['dqn', 'ppo', 'grpo'\], got 'sac'",
        ),
        (TrainConfig(plane=PlaneConfig(sampler="exact")), "plane.sampler: expected one of"),
        (TrainConfig(plane=PlaneConfig(max_lag=3)), r"plane.max_lag: expected one of \[0, 1\]"),
        (TrainConfig(plane=PlaneConfig(placement="nearest")), "plane.placement"),
        # a bool matches only a bool: 1 is not true, nor true 1
        (
            TrainConfig(plane=PlaneConfig(shared_memory=1)),
            r"plane.shared_memory: expected one of \['auto', True, False\], got 1",
        ),
        (TrainConfig(plane=PlaneConfig(max_lag=True)), r"plane.max_lag: .* got True"),
        (
            TrainConfig(plane=PlaneConfig(weights_bucket_mb=0.0)),
            r"plane.weights_bucket_mb: expected a finite number > 0 or null, got 0.0",
        ),
        # DQN actors outside the job: the settings that go with them
        (TrainConfig(algo=AlgoConfig(actors="remote")), r"algo.actors: expected one of"),
        (
            TrainConfig(mode="colocated", algo=AlgoConfig(actors="attached", attach_dir="d")),
            r"mode: expected 'disaggregated' with attached actors .*got 'colocated'",
        ),
        (
            TrainConfig(mode="disaggregated", algo=AlgoConfig(actors="attached")),
            r"algo.attach_dir: expected the ingresses' run directory .* got None",
        ),
        (
            TrainConfig(target_return=100.0, algo=AlgoConfig(role="actor", attach_dir="d")),
            r"target_return: expected None with attached actors \(the returns are the actors'",
        ),
    ],
)
def test_unknown_values_are_errors(cfg, message):
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


def test_defaults_are_in_the_tables():
    cfg = TrainConfig()
    validate(cfg)
    assert cfg.plane.sampler in registry.TRAIN_SAMPLERS
    assert cfg.plane.placement in registry.TRAIN_PLACEMENTS
    assert cfg.algo.grad_sync in registry.GRAD_SYNCS


def test_sampler_auto_resolves_per_algorithm():
    """plane.sampler=auto (the default): DQN samples uniformly, as before ``auto``; PPO reads
    each rollout ``algo.ppo.epochs`` times without replacement."""
    dqn = TrainConfig()
    assert dqn.plane.sampler == "auto" and setup.sampler(dqn) == "uniform"
    assert setup.grad_sync(dqn, [0, 1]) == "round"  # auto is uniform there too
    ppo = TrainConfig(algo=AlgoConfig(name="ppo", ppo=PPOConfig(epochs=3, shuffle="global")))
    got = setup.sampler(ppo)
    assert isinstance(got, WithoutReplacement) and (got.epochs, got.shuffle) == (3, "global")


def test_placement_auto_resolves_per_algorithm():
    """auto: PPO keeps each rollout where it was collected in both modes; DQN disaggregated
    spreads items round robin."""
    for mode in ("colocated", "disaggregated"):
        ppo = TrainConfig(mode=mode, algo=AlgoConfig(name="ppo"))
        assert setup.placement(ppo) == "local"
    assert setup.placement(TrainConfig(mode="disaggregated")) == "round_robin"
    explicit = TrainConfig(algo=AlgoConfig(name="ppo"), plane=PlaneConfig(placement="round_robin"))
    assert setup.placement(explicit) == "round_robin"
