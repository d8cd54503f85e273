"""A ``DataPlane``'s side of the attach ingress (``attach/ingress.py``): an attached producer's
put is staged on this rank as the rank's own ``put`` would stage it (checked whole, NaN/inf
refused), for the next round. Rows are whole per put, so a producer that dies leaves nothing
incomplete: what it had acknowledged stays, what it had not was never stored. (Rows do not
remember their producer once stored, so the ledger counts rows put and acknowledged, not
delivered, on this plane.)"""

from __future__ import annotations

import torch

from conduit_dist.attach.ingress import Retry
from conduit_dist.errors import ConfigError


class RowTarget:
    """The ingress target of one ``DataPlane`` rank.

    Args:
        plane: the ``DataPlane``.
    """

    kind = "rows"

    def __init__(self, plane) -> None:
        self.plane, self.rank = plane, plane.rank

    def describe(self) -> dict:
        """The experience spec as JSON: each user field's shape and dtype."""
        fields = self.plane._p.stager.user_spec.fields
        return {
            "fields": {
                n: {"dtype": str(f.dtype).removeprefix("torch."), "shape": list(f.shape)}
                for n, f in fields.items()
            }
        }

    def version(self) -> int:
        """The newest policy version this rank knows."""
        return self.plane.policy_version

    def store(self, tensors: dict[str, torch.Tensor], version: int | None) -> tuple[int, list]:
        """Stage one attached put (whole or not at all; the rate limiter is not consulted: an
        attached producer is paced by its acknowledgements).

        Raises:
            SpecError: naming the field, as ``DataPlane.put``.
            Retry: with ``max_lag=0`` while the next fetch's round is in flight (the put waits
                for the next drain).
        """
        p = self.plane._p
        try:
            p.stager.check_lag("attached put")
        except ConfigError:  # max_lag=0 and the next fetch's round in flight: after it
            raise Retry() from None
        p.stager.put(tensors, False, version)  # checked there, whole or not at all
        p.control.poll()
        return int(next(iter(tensors.values())).shape[0]), []

    def incomplete(self, gids: list[int]) -> list[int]:
        """Rows are whole per put: nothing is ever incomplete."""
        return []

    def drop(self, gids: list[int]) -> None:
        """Nothing to drop (see :meth:`incomplete`)."""

    def holds(self, gid: int) -> bool:
        """Rows have no groups: none is ever held by id."""
        return False

    def weights(self) -> tuple[int, torch.Tensor | None]:
        """The newest weights this rank holds whole (published here or received in a round)."""
        return self.plane._p.weights.whole()
