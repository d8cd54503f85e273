"""A token plane rank's policy version and the weights behind it (``TokenVersions``).

Every learner's ``publish_weights`` advances the version and, where producer-only ranks or an
ingress exist, packs its part of the model's weights (learner ``i`` of ``L``: about ``1/L`` of
the bytes, ``flow/weights.py``; device buffers on a CUDA plane), which the next round sends to
the ranks that load them; a producer-only rank's version is the newest weights it pulled.
Pacing, staleness and the rounds read this version.
"""

from __future__ import annotations

from torch import nn

from conduit_dist.errors import ConfigError


class TokenVersions:
    """This rank's policy version and the plane's weights.

    Args:
        weights: the plane's ``WeightsState``.
        rank: this rank.
        learners: the learner ranks (each packs its part of a version).
        world: the plane's world size (producer-only ranks: weights are sent).
    """

    def __init__(self, weights, rank: int, learners: list[int], world: int) -> None:
        self.weights, self.version = weights, 0
        # which part of a version this rank packs (None: a producer-only rank, packs none)
        self.part = (learners.index(rank), len(learners)) if rank in learners else None
        self.sends = any(r not in learners for r in range(world))
        self.serves = False  # an ingress is open: this rank serves whole versions

    @property
    def wants_whole(self) -> bool:
        """Whether rounds send this rank every part of a version (producer-only ranks, and a
        learner whose ingress serves attached producers)."""
        return self.part is None or self.serves

    def publish(self, model: nn.Module | None, lazy: bool = False) -> int:
        """Advance the version (packing ``model`` where weights are sent; ``lazy``: packed by
        the round that sends it, ``WeightsState.publish``); returns it.

        Raises:
            ConfigError: when producer-only ranks or an ingress exist and a learner gives no
                ``model``.
        """
        if self.part is not None and self.sends:
            if model is None:
                raise ConfigError(
                    "publish_weights: expected the model (producer-only ranks or "
                    "attached producers pull its weights), got None"
                )
            self.weights.publish(model, self.part, lazy)
            self.version = self.weights.version
        else:
            self.version += 1
        return self.version

    def pull(self, model: nn.Module, in_place: bool = False) -> int:
        """Load the newest whole weights received into ``model`` (``in_place``: as views of the
        received buffer, ``WeightsState.pull``); returns this rank's version."""
        self.version = max(self.version, self.weights.pull(model, in_place))
        return self.version
