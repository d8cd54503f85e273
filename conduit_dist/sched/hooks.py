"""Backward-start detection on a learner's module, with no change to the user's loss code.

A forward hook on the module registers, for each forward whose outputs require grad, a hook on
those output tensors. The first output gradient computed is the start of the module's backward
pass: the trigger calls ``on_backward`` once (per forward), on whatever thread autograd runs it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    return []


class BackwardTrigger:
    """Calls ``on_backward()`` when backward reaches ``module``'s outputs.

    Args:
        module: the learner's module (a DDP wrapper is unwrapped: hooks go on ``.module``).
        on_backward: called at backward start (at most once per forward with grad).
        on_forward: called after every forward with its ``(start, end)`` times (optional).
        active: ``False`` where neither callback could ever act (a fixed ``sync`` schedule with no
            trace): the module counts as attached but carries no hook, since hooks cost every
            forward ~17 us (torch's hooked call path, a hook per output tensor, a Python call in
            the backward).

    Raises:
        TypeError: if ``module`` is not an ``nn.Module``.
    """

    def __init__(
        self,
        module: nn.Module,
        on_backward: Callable[[], None],
        on_forward: Callable[[float, float], None] | None = None,
        active: bool = True,
    ) -> None:
        if isinstance(module, nn.parallel.DistributedDataParallel):
            module = module.module
        if not isinstance(module, nn.Module):
            raise TypeError(f"attach: expected an nn.Module, got {type(module).__name__}")
        self.module = module
        self._on_backward = on_backward
        self._on_forward = on_forward
        self._forward_start = 0.0
        self._attached = True
        self._handles: list = []
        if active:
            self.activate()

    def _pre_hook(self, _module: nn.Module, _inputs: Any) -> None:
        self._forward_start = time.perf_counter()

    def _forward_hook(self, _module: nn.Module, _inputs: Any, output: Any) -> None:
        if self._on_forward is not None:
            self._on_forward(self._forward_start, time.perf_counter())
        outs = [t for t in _tensors(output) if t.requires_grad]
        if not outs:
            return
        fired = [False]

        def hook(grad: torch.Tensor) -> None:
            if not fired[0]:
                fired[0] = True
                self._on_backward()

        for t in outs:
            t.register_hook(hook)

    def activate(self) -> None:
        """Put the hooks on the module (no-op if they are on)."""
        if not self._handles:
            self._handles = [
                self.module.register_forward_pre_hook(self._pre_hook),
                self.module.register_forward_hook(self._forward_hook),
            ]

    def deactivate(self) -> None:
        """Remove the hooks but stay attached (nothing will need them again: an auto trial that
        settled on ``sync`` with no trace)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def remove(self) -> None:
        """Remove every hook this trigger registered."""
        self.deactivate()
        self._attached = False

    @property
    def attached(self) -> bool:
        """Whether the module is still attached (:meth:`remove` not called yet)."""
        return self._attached

    @property
    def hooked(self) -> bool:
        """Whether hooks are in place on the module (attached and ``active``)."""
        return bool(self._handles)
