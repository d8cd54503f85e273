"""A token plane's side of the attach ingress (``attach/ingress.py``): what an attached
producer's put becomes on this rank's shard, which of its groups are incomplete, and the
weights it pulls. Every call runs on the plane's own thread, after any round launched ahead
ended (``runner.settle``), so the shard is never read by a round meanwhile."""

from __future__ import annotations

import numpy as np
import torch

from conduit_dist.errors import SpecError


def _dtype(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


class TokenTarget:
    """The ingress target of one ``TokenPlane`` rank.

    Args:
        plane: the ``TokenPlane``.
    """

    kind = "tokens"

    def __init__(self, plane, per_version: int | None = None) -> None:
        self.plane, self.rank = plane, plane.rank
        self.per_version = per_version  # groups an attached producer may start per version

    def describe(self) -> dict:
        """The token spec as JSON: ragged and fixed fields, the group field and size."""
        spec = self.plane.spec
        return {
            "ragged": {
                n: {"dtype": _dtype(f.dtype), "max_len": f.max_len, "inner": list(f.inner)}
                for n, f in spec.ragged.items()
            },
            "fixed": {
                n: {"dtype": _dtype(f.dtype), "shape": list(f.shape)} for n, f in spec.fixed.items()
            },
            "group": spec.group,
            "group_size": spec.group_size,
            # AttachedProducer.reserve: at most per_version groups a learner version, up to
            # max_age + 1 versions ahead (None: not paced)
            "pacing": {"per_version": self.per_version, "max_age": self.plane.engine.max_age},
        }

    def version(self) -> int:
        """The first learner's version as of the last round (what pacing and staleness use)."""
        return max(self.plane.newest, self.plane.version)

    def store(self, tensors: dict[str, torch.Tensor], version: int | None) -> tuple[int, list]:
        """One attached put through the rank's own checked ``put`` (whole or not at all).

        Raises:
            SpecError: naming the field; ConfigError: as ``TokenPlane.put``.
        """
        lengths = tensors.pop("__lengths__", None)
        if lengths is None:
            raise SpecError("attached put: expected the sequence lengths (__lengths__), got none")
        self.plane.producer.put(tensors, lengths, version, None)
        gids = tensors[self.plane.spec.group].reshape(-1)
        return int(lengths.numel()), np.unique(gids.numpy()).tolist()

    def incomplete(self, gids: list[int]) -> list[int]:
        """Of ``gids``, the groups on this shard still waiting for members."""
        self.plane.runner.settle()
        groups = self.plane.store.groups
        return [g for g in gids if g in groups and groups[g].complete_at < 0]

    def drop(self, gids: list[int]) -> None:
        """Remove incomplete groups (their producer is gone; the ledger counts them); members
        arriving later are dropped too (``GroupStore.evict``'s tombstones)."""
        self.plane.runner.settle()
        self.plane.store.evict(gids)

    def holds(self, gid: int) -> bool:
        """Whether group ``gid`` is on this shard."""
        return gid in self.plane.store.groups

    def weights(self) -> tuple[int, torch.Tensor | None]:
        """The newest weights this rank holds whole (published here, or completed in a round
        from the learners' parts)."""
        return self.plane.weights.whole()
