"""A token plane rank's policy version and the weights behind it (``TokenVersions``).

The first learner's ``publish_weights`` advances the version and, where producer-only ranks
exist, packs the model's weights for the next round's broadcast (``flow/weights.py``: device
buffers on a CUDA plane); the other learners count along; a producer-only rank's version is
the newest weights it pulled. Pacing, staleness and the rounds read this version.
"""

from __future__ import annotations

from torch import nn

from conduit_dist.errors import ConfigError


class TokenVersions:
    """This rank's policy version and the plane's weights.

    Args:
        weights: the plane's ``WeightsState``.
        rank: this rank.
        learners: the learner ranks (the first one publishes).
        world: the plane's world size (producer-only ranks: weights are sent).
    """

    def __init__(self, weights, rank: int, learners: list[int], world: int) -> None:
        self.weights, self.version = weights, 0
        self.publisher = rank == learners[0]
        self.sends = any(r not in learners for r in range(world))

    def publish(self, model: nn.Module | None) -> int:
        """Advance the version (packing ``model`` where weights are sent); returns it.

        Raises:
            ConfigError: when producer-only ranks exist and no ``model`` is given.
        """
        if self.publisher and self.sends:
            if model is None:
                raise ConfigError(
                    "publish_weights: expected the model (producer-only ranks or "
                    "attached producers pull its weights), got None"
                )
            self.weights.publish(model)
            self.version = self.weights.version
        else:
            self.version += 1
        return self.version

    def pull(self, model: nn.Module) -> int:
        """Load the newest weights received into ``model``; returns this rank's version."""
        self.version = max(self.version, self.weights.pull(model))
        return self.version
