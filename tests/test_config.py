"""Config values resolve through the registry's tables: an unknown value is an error naming it."""

from __future__ import annotations

import pytest

from conduit_dist import registry
from conduit_dist.errors import ConfigError
from conduit_dist.train.config import AlgoConfig, PlaneConfig, TrainConfig, validate


@pytest.mark.parametrize(
    "cfg, message",
    [
        (
            TrainConfig(algo=AlgoConfig(name="sac")),
            r"algo.name: expected one of \['dqn', 'ppo'\], got 'sac'",
        ),
        (TrainConfig(plane=PlaneConfig(sampler="exact")), "plane.sampler: expected one of"),
        (TrainConfig(plane=PlaneConfig(max_lag=3)), r"plane.max_lag: expected one of \[0, 1\]"),
        (TrainConfig(plane=PlaneConfig(placement="nearest")), "plane.placement"),
    ],
)
def test_unknown_values_are_errors(cfg, message):
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


def test_defaults_are_in_the_tables():
    cfg = TrainConfig()
    validate(cfg)
    assert cfg.plane.sampler in registry.SAMPLERS
    assert cfg.plane.placement in registry.TRAIN_PLACEMENTS
    assert cfg.algo.grad_sync in registry.GRAD_SYNCS
