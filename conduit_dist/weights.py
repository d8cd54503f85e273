"""Versioned learner weights, packed into one byte buffer and broadcast in a round (no pickle)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from conduit_dist.collectives.exchange import Exchange
from conduit_dist.errors import SpecError
from conduit_dist.spec import ExperienceSpec


@dataclass(frozen=True)
class WeightsSnapshot:
    """What the publisher had published when a round was prepared."""

    version: int
    buf: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        """Packed size."""
        return 0 if self.buf is None else self.buf.numel()


def _layout(module: nn.Module) -> tuple[ExperienceSpec, dict[str, torch.Tensor]]:
    state = {k: v.detach()[None] for k, v in module.state_dict().items()}
    if not state:
        raise SpecError("weights: expected a module with parameters or buffers, got none")
    return ExperienceSpec.from_batch(state, allow_nonfinite=True), state


class WeightsState:
    """The publisher's packed weights, or the latest weights received, with their version.

    Buffers are replaced, never written in place, so a round running on another thread always
    reads or hands over a complete buffer.
    """

    def __init__(self) -> None:
        self.version = 0
        self.buf: torch.Tensor | None = None
        self.broadcast = 0  # last version broadcast (the same on every rank)

    def snapshot(self) -> WeightsSnapshot:
        """The current version and buffer (taken when a round is prepared)."""
        return WeightsSnapshot(self.version, self.buf)

    def publish(self, module: nn.Module) -> None:
        """Pack ``module``'s state into a new buffer and bump the version."""
        spec, state = _layout(module)
        buf = torch.empty(spec.record_bytes, dtype=torch.uint8)
        spec.pack(state, buf.view(1, -1))
        self.buf = buf
        self.version += 1

    def exchange(
        self, ex: Exchange, meta: np.ndarray, src: int, r: int, snap: WeightsSnapshot
    ) -> None:
        """Broadcast from ``src`` if its version is newer than the last broadcast (all ranks)."""
        version, nbytes = int(meta[src, 2]), int(meta[src, 3])
        if version <= self.broadcast:
            return
        buf = snap.buf if ex.rank == src else torch.empty(nbytes, dtype=torch.uint8)
        ex.broadcast(buf, src, r)
        self.broadcast = version
        if ex.rank != src:
            self.buf, self.version = buf, version

    def pull(self, module: nn.Module) -> int:
        """Copy the latest weights into ``module``; returns their version (0: none yet)."""
        buf, version = self.buf, self.version
        if version == 0 or buf is None:
            return 0
        spec, state = _layout(module)
        if spec.record_bytes != buf.numel():
            raise SpecError(
                f"weights: module state packs to {spec.record_bytes} bytes, the published weights "
                f"are {buf.numel()} bytes; is it the learner's architecture?"
            )
        fields = spec.unpack(buf.view(1, -1))
        with torch.no_grad():
            for name, t in state.items():
                t.copy_(fields[name])
        return version
