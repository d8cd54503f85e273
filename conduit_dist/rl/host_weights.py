"""Weights between a network on the GPU and the data plane, one copy each way.

The plane publishes and pulls weights on the host (``publish_weights`` packs a module's
``state_dict`` into a host buffer; ``pull_weights`` copies one into a module). Handed a module on
the GPU, that is one small device-to-host copy, and one host sync, per tensor. :class:`HostWeights`
keeps a host mirror of the network whose tensors are views of one flat (pinned) host buffer:
publishing gathers the network's tensors into one flat device buffer (device-side copies, queued
on the stream) and copies it to the host once; pulling copies the host buffer to the device once,
only when a new version arrived, and scatters it on the device. On the CPU the network is handed
to the plane itself, as before.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch
from torch import nn

from conduit_dist.records.layout import align


def _tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    """A module's parameters and buffers (shared ones once), in a fixed order."""
    yield from module.parameters()
    yield from module.buffers()


class HostWeights:
    """A network's weights as the data plane sees them: on the host.

    Args:
        module: the network (on ``device``; not wrapped in DDP).
        device: where ``module`` lives, resolved (``cpu`` or ``cuda:<index>``).
        mirror: keep the host mirror (``None``: where ``device`` is not the CPU; ``True`` on the
            CPU runs the same copies there, as the tests do).

    Example::

        weights = HostWeights(agent.q, device)
        version = weights.publish(plane)  # learner: one device-to-host copy
        version = weights.pull(plane)  # actor: one host-to-device copy when the version is new
    """

    def __init__(self, module: nn.Module, device: torch.device, mirror: bool | None = None) -> None:
        self.module, self.device = module, device
        self.mirrored = device.type != "cpu" if mirror is None else mirror
        self.on_device = 0  # the version last copied to the device (mirrored)
        self.host = module
        if not self.mirrored:
            return
        tensors = list(_tensors(module))
        self._spans, at = [], 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            self._spans.append((at, at + nbytes))
            at = align(at + nbytes)
        self._dev = torch.empty(at, dtype=torch.uint8, device=device)
        pin = device.type == "cuda"
        self._flat = torch.empty(at, dtype=torch.uint8, pin_memory=pin)
        with torch.no_grad():
            self.host = copy.deepcopy(module).to("cpu")
            for t, (a, b) in zip(_tensors(self.host), self._spans, strict=True):
                view = self._flat[a:b].view(t.dtype).view(t.shape)
                view.copy_(t)
                t.data = view  # the mirror's tensors are views of the flat host buffer

    def to_host(self) -> nn.Module:
        """The host mirror, holding the network's current weights (mirrored: one flat
        device-to-host copy); the network itself on the CPU."""
        if self.mirrored:
            with torch.no_grad():
                for t, (a, b) in zip(_tensors(self.module), self._spans, strict=True):
                    self._dev[a:b].view(t.dtype).copy_(t.reshape(-1))  # queued on the device
                self._flat.copy_(self._dev)  # the one device-to-host copy
        return self.host

    def to_device(self) -> None:
        """Copy the host mirror's weights into the network (mirrored: one flat host-to-device
        copy, then device-side copies into each tensor)."""
        if not self.mirrored:
            return
        with torch.no_grad():
            # blocking: the next pull rewrites the host buffer in place
            self._dev.copy_(self._flat)
            for t, (a, b) in zip(_tensors(self.module), self._spans, strict=True):
                t.copy_(self._dev[a:b].view(t.dtype).view(t.shape))

    def publish(self, plane) -> int:
        """``plane.publish_weights`` of the network; returns the version (see
        :meth:`~conduit_dist.flow.versions.PolicyVersions.publish`). Only the first learner
        packs the weights, so only there are they copied to the host."""
        packs = plane.rank == plane.learner_ranks[0]
        return plane.publish_weights(self.to_host() if packs else self.host)

    def pull(self, plane) -> int:
        """``plane.pull_weights`` into the network; returns the version (0: none yet).
        Mirrored, the host mirror takes the weights and the network gets them only when the
        version is new (one host-to-device copy)."""
        version = plane.pull_weights(self.host)
        if self.mirrored and version and version != self.on_device:
            self.to_device()
            self.on_device = version
        return version
