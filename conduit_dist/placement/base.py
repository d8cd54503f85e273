"""The placement protocol: which shard each staged item of a round goes to.

Every rank computes the same plan from the round's staged counts, which all ranks hold after the
meta exchange, so no extra round trip is needed. A plan is a ``[world, world]`` matrix
``send[src, dst]`` of item counts; each source's items to one destination are contiguous in its
staging buffer, in destination order, so the plan maps directly onto ``all_to_all_single`` splits.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from conduit_dist.sampling.base import Sampler


@dataclass(frozen=True)
class PlacementContext:
    """What a plane tells its placement when it is built (the same on every rank).

    Attributes:
        world: number of shards.
        links: ``[world, world]`` link class index (0 self, 1 host, 2 net).
        learners: ``[world]`` bool, ranks that fetch.
        record_bytes: bytes per item.
        model: the bandwidth model every rank agrees on.
        sampler: the plane's sampler (for the delivery a plan leads to).
    """

    world: int
    links: np.ndarray
    learners: np.ndarray
    record_bytes: int
    model: object
    sampler: Sampler


class Placement(ABC):
    """Plans a round's ingestion. Plans must depend only on replicated inputs."""

    name: str = "abstract"
    ctx: PlacementContext | None = None
    # True when every plan is the diagonal (items stay where they were put): a round then
    # needs no ingestion exchange and can fuse its meta with delivery
    keeps_local: bool = False

    def bind(self, ctx: PlacementContext) -> None:
        """Attach to a plane (called once, when the plane is built)."""
        self.ctx = ctx

    @abstractmethod
    def plan(
        self, staged: np.ndarray, requests: np.ndarray, sizes: np.ndarray, capacity: int
    ) -> np.ndarray:
        """``int64 [world, world]`` items from each source to each destination this round.

        Args:
            staged: ``[world]`` items staged on each rank.
            requests: ``[world]`` batch size each rank fetches this round.
            sizes: ``[world]`` items on each shard before this round.
            capacity: items one shard holds.
        """

    def route(self, src: int, keys: np.ndarray) -> np.ndarray:
        """The shard each staged item of rank ``src`` goes to, by its stream key, for samplers
        whose windows need a stream's consecutive items on one shard (``Streams``). It must be
        a stable function of ``(src, key)`` so a stream never moves; by default a stream stays
        on the shard of the rank that put it.

        Args:
            src: the putting rank.
            keys: ``int64 [n]`` each staged item's stream key within ``src``.

        Returns:
            ``int64 [n]`` destination shards.
        """
        return np.full(keys.shape[0], src, dtype=np.int64)

    def observe(  # noqa: B027 (default: nothing to learn)
        self, staged: np.ndarray, requests: np.ndarray, sizes: np.ndarray, capacity: int
    ) -> None:
        """A routed round's replicated inputs (as :meth:`plan` gets them), for a placement that
        chooses its routing from what rounds look like."""

    def state_dict(self) -> dict[str, object]:
        """Placement state that must survive a checkpoint (none by default)."""
        return {}

    def load_state_dict(self, state: dict[str, object]) -> None:  # noqa: B027 (default: none)
        """Restore :meth:`state_dict`."""
