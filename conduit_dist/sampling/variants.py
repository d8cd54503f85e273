"""The variants ``Prioritized(...)`` builds: priorities routed back to their owners
(``alpha > 0``: :class:`~conduit_dist.sampling.base.RoutesFeedback`), windows instead of items
(``sequence``: :class:`~conduit_dist.sampling.base.Streams`), or both. Each is a
:class:`~conduit_dist.sampling.prioritized.Prioritized`; the capabilities are its type."""

from __future__ import annotations

import inspect
import math

import numpy as np
import torch

from conduit_dist.errors import ConfigError
from conduit_dist.sampling.base import ReadsColumns, RoutesFeedback, Streams
from conduit_dist.sampling.prioritized import Prioritized
from conduit_dist.sampling.sequences import Episodes
from conduit_dist.sampling.updates import UpdateQueue, apply_updates

_SIGNATURE = inspect.signature(Prioritized.__init__)


def variant(*args, **kwargs) -> type[Prioritized]:
    """The class ``Prioritized(*args, **kwargs)`` builds (bad values are left to its checks)."""
    try:
        bound = _SIGNATURE.bind(None, *args, **kwargs)
    except TypeError:
        return Prioritized  # __init__ raises the TypeError with the right message
    bound.apply_defaults()
    alpha, sequence = bound.arguments["alpha"], bound.arguments["sequence"]
    routed = isinstance(alpha, int | float) and not isinstance(alpha, bool) and alpha > 0
    return _VARIANTS[(routed, sequence is not None)]


class RoutedPrioritized(Prioritized, RoutesFeedback):
    """Prioritized replay whose learners send priorities back (``alpha > 0``)."""

    def bind(self, ctx) -> None:
        """Attach to a plane (and make the update queue for its world)."""
        super().bind(ctx)
        self.updates = UpdateQueue(ctx.rank, ctx.world)

    def _apply(self) -> None:
        """Apply the updates received for this shard (stale generations are dropped)."""
        upd = self.updates.take_own()
        if upd is None:
            return
        applied, top = apply_updates(
            self.tree, self._gen, self.storage.capacity, self._lo, upd, self.alpha, self.eps
        )
        self.applied += applied
        self.dropped += upd.shape[0] - applied
        self.max_priority = max(self.max_priority, top)

    def queue_updates(self, index: torch.Tensor, value: torch.Tensor) -> None:
        """Check and queue updates (see ``UpdateQueue.queue``; ``ConfigError`` on bad values,
        including priorities whose masses ``(p + eps) ** alpha`` overflow summed over the global
        store)."""
        items = self.storage.capacity * self.ctx.world
        room = 709.0 - math.log(items)  # log of the largest mass
        if index.numel() and self.alpha * 709.8 >= room:  # a finite p can overflow it
            big = float(value.max())
            if big + self.eps > 0 and math.log(big + self.eps) * self.alpha >= room:
                raise ConfigError(
                    f"update_priorities priority: (p + eps) ** alpha must be finite over the "
                    f"store's {items} items; got p={big} with alpha={self.alpha}"
                )
        self.updates.queue(index, value)

    def outgoing(self, budgets: dict[int, int]) -> dict[int, torch.Tensor]:
        """Up to ``budgets[peer]`` queued updates per peer, oldest first."""
        return self.updates.outgoing(budgets)

    def incoming(self, rows: torch.Tensor) -> None:
        """Updates another learner sent this shard (applied at the next round's start)."""
        self.updates.incoming(rows)

    def pending(self) -> int:
        """Updates queued on this rank and not yet sent or applied."""
        return self.updates.pending()

    def state_dict(self) -> dict[str, object]:
        """The trees and the updates not applied yet (queued for others or received here)."""
        return {**super().state_dict(), **self.updates.state_dict()}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict`."""
        super().load_state_dict(state)
        self.updates.load_state_dict(state)

    def restore_state(self, states, exact, rank, written) -> None:
        """On the same world size also this rank's queued updates (their addresses still hold);
        else they are dropped and counted (the items were renumbered)."""
        super().restore_state(states, exact, rank, written)
        if exact:
            self.updates.load_state_dict(states[rank])
        elif rank == 0:  # each old update counted once
            self.dropped += sum(int(s["queued"].shape[0] + s["received"].shape[0]) for s in states)


class WindowedPrioritized(Prioritized, Streams, ReadsColumns):
    """Prioritized (or, with ``alpha = 0``, uniform) draws of windows: slices or n-step."""

    def layout(self, spec) -> tuple[object, int]:
        """Stored as put; delivered as ``Windows.wire_bytes`` rows."""
        return spec, self.sequence.wire_bytes(spec.record_bytes)

    def _trailer_at(self, spec) -> int:
        return self.sequence.trailer_at(spec.record_bytes)

    def attach(self, storage, spec) -> None:
        """Track ``storage``'s items and their streams."""
        super().attach(storage, spec)
        self.episodes = Episodes(self.sequence, spec, storage, self._gen, self.ctx.device_rows)

    def ingested_rows(self, first: int, rows: torch.Tensor) -> None:
        """On a device-rows plane: keep the host copy of the columns links read."""
        if self.episodes.shadow is not None:
            self.episodes.shadow.fill(first, rows)

    def _enter(self, gens: np.ndarray, top: float) -> None:
        """A new item becomes a start (drawable) once its window is in."""
        cap = self.storage.capacity
        self.tree.fill(torch.from_numpy(gens % cap), 0.0)
        starts = self.episodes.ingest(torch.from_numpy(gens))
        self.tree.fill(torch.from_numpy(starts.numpy() % cap), top)

    def stream_keys(self, records: torch.Tensor) -> torch.Tensor:
        """Each staged record's stream within its rank (the ``stream`` field, or 0)."""
        return self.episodes.keys(records)

    def arrived(self, sources: np.ndarray) -> None:
        """Which rank sent each of this round's new items (in arrival order)."""
        self.episodes.arrived(sources)

    def write_rows(self, generations: torch.Tensor, out: torch.Tensor) -> None:
        """Delivered rows of drawn starts: their windows, n-step values, address and mass
        (on a device-rows plane the n-step values travel up with the address and mass)."""
        vals = self.episodes.compose(generations, out)
        self._tag(generations, out, None if vals is None else vals.view(np.int64))

    def read_rows(self, rows: torch.Tensor, unpack) -> dict[str, torch.Tensor]:
        """Windows' fields (``[B, T, ...]`` or n-step entries) and ``_index``/``_weight``."""
        return {**self.episodes.unpack(rows), **self.entries(rows)}

    def state_dict(self) -> dict[str, object]:
        """The trees and the stream links."""
        return {**super().state_dict(), "episodes": self.episodes.state_dict()}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict` (``ConfigError`` without stream links)."""
        super().load_state_dict(state)
        self.episodes.load_state_dict(state["episodes"])

    def item_state(self, generations: torch.Tensor) -> dict[str, torch.Tensor]:
        """Masses and each item's source rank (its stream's identity with the key)."""
        out = super().item_state(generations)
        return {**out, "source": self.episodes.sources_of(generations)}

    def restore_begin(self, base: int) -> None:
        """Empty the tree and the stream links."""
        super().restore_begin(base)
        self.episodes.reset()

    def restore_piece(self, generations: torch.Tensor, items: dict[str, torch.Tensor]) -> None:
        """Link the piece's items (not to another piece's) and give each its saved mass."""
        self.episodes.forget_streams()
        self.episodes.arrived_items(items["source"])
        super().restore_piece(generations, items)

    def restore_state(self, states, exact, rank, written) -> None:
        """Items put after the restore link to no old stream's tail (new episodes)."""
        super().restore_state(states, exact, rank, written)
        self.episodes.forget_streams()


class RoutedWindowedPrioritized(RoutedPrioritized, WindowedPrioritized):
    """Windows with priorities routed back."""


_VARIANTS = {
    (False, False): Prioritized,
    (True, False): RoutedPrioritized,
    (False, True): WindowedPrioritized,
    (True, True): RoutedWindowedPrioritized,
}
