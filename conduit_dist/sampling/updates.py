"""Priority updates between ``update_priorities`` on a learner and the shard that owns the item.

A learner's updates are checked and grouped by owner in one pass (native, or the same in torch),
then wait here: the owner's own part until its next round starts, other shards' parts until a
one-exchange round has room for them (``outgoing``); what a peer sent this shard waits
(``incoming``) for the same round start. Every list is guarded by one lock: the caller queues on
its thread, rounds take on theirs.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from conduit_dist.errors import ConfigError
from conduit_dist.records.spec import _native

RANK_SHIFT = 48  # _index = rank << 48 | generation
GEN_MASK = (1 << RANK_SHIFT) - 1


class UpdateQueue:
    """Queued ``(generation, priority bits)`` int64 pairs, by owner rank.

    Args:
        rank: this shard's rank.
        world: number of shards.
    """

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self._lock = threading.Lock()
        self._pending: dict[int, list[torch.Tensor]] = {}  # owner -> [k, 2] rows
        self._received: list[torch.Tensor] = []  # [k, 2] rows for this shard

    def queue(self, index: torch.Tensor, priority: torch.Tensor) -> None:
        """Check and queue updates (contiguous CPU int64 ``[k]`` addresses and float64 ``[k]``
        priorities), grouped by the shard that owns each item.

        Raises:
            ConfigError: on a NaN, infinite or negative priority, or an address of no rank
                (nothing is queued then).
        """
        world, n = self.world, index.numel()
        rows = torch.empty((n, 2), dtype=torch.int64)
        counts = np.zeros(world, dtype=np.int64)
        if _native is not None:
            bad = _native.queue_updates(
                index.data_ptr(), priority.data_ptr(), n, world, RANK_SHIFT, rows.data_ptr(),
                counts.ctypes.data,
            )  # fmt: skip
        else:
            bad = _group(index, priority, rows, counts)
        if bad >= 0:
            pos = bad // 2
            if bad % 2 == 0:
                raise ConfigError(
                    "update_priorities priority: expected finite values >= 0, got "
                    f"{float(priority[pos])} at position {pos}"
                )
            rank = int(index[pos]) >> RANK_SHIFT if int(index[pos]) >= 0 else -1
            raise ConfigError(
                "update_priorities index: expected '_index' entries of fetched batches (ranks "
                f"0..{world - 1}), got rank {rank} at position {pos}"
            )
        with self._lock:
            at = 0
            for owner, k in enumerate(counts.tolist()):
                if k:
                    self._pending.setdefault(owner, []).append(rows[at : at + k])
                    at += k

    def outgoing(self, budgets: dict[int, int]) -> dict[int, torch.Tensor]:
        """Up to ``budgets[peer]`` queued updates per peer (``[k, 2]`` int64), oldest first; the
        rest stay queued."""
        out = {}
        with self._lock:
            for peer, budget in budgets.items():
                queued = self._pending.get(peer)
                if not queued or budget <= 0:
                    continue
                rows = torch.cat(queued) if len(queued) > 1 else queued[0]
                out[peer] = rows[:budget]
                rest = rows[budget:]
                self._pending[peer] = [rest] if rest.numel() else []
        return out

    def incoming(self, rows: torch.Tensor) -> None:
        """Updates another learner sent this shard (rows the queue may keep: a copy)."""
        if rows.numel():
            with self._lock:
                self._received.append(rows)

    def take_own(self) -> torch.Tensor | None:
        """Everything for this shard (received and this rank's own), as ``[k, 2]`` rows."""
        with self._lock:
            rows, self._received = self._received, []
            rows = rows + self._pending.pop(self.rank, [])
        if not rows:
            return None
        return torch.cat(rows) if len(rows) > 1 else rows[0]

    def pending(self) -> int:
        """Updates queued here and not yet sent or applied."""
        with self._lock:
            return sum(int(r.shape[0]) for q in self._pending.values() for r in q)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``queued`` (``[k, 3]``: owner, generation, priority bits) and ``received``."""
        with self._lock:
            queued = [
                torch.cat([torch.full((r.shape[0], 1), owner), r], dim=1)
                for owner, rows in self._pending.items()
                for r in rows
            ]
            received = list(self._received)
        empty = torch.zeros((0, 3), dtype=torch.int64)
        return {
            "queued": torch.cat(queued) if queued else empty,
            "received": torch.cat(received) if received else empty[:, :2],
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict`."""
        queued = state["queued"]
        with self._lock:
            self._pending = {}
            for owner in torch.unique(queued[:, 0]).tolist():
                self._pending[owner] = [queued[queued[:, 0] == owner, 1:].clone()]
            self._received = [state["received"].clone()] if state["received"].numel() else []


def apply_updates(tree, gen, cap, lo, upd, alpha: float, eps: float) -> tuple[int, float]:
    """Apply ``upd`` (``[k, 2]``: generation, priority bits) to the leaves of ``tree`` whose
    generation (``gen[g % cap]``) still matches and is at least ``lo``; returns ``(applied,
    largest priority applied or -1)``. One native loop (check, mass, leaf and ancestors per
    update), or the same in torch."""
    if _native is not None:
        upd = upd.contiguous()
        applied, top = _native.tree_update(
            tree.sum.data_ptr(), tree.min.data_ptr(), tree.offs.data_ptr(), tree.H,
            gen.data_ptr(), cap, lo, upd.data_ptr(), upd.shape[0], alpha, eps,
        )  # fmt: skip
        return int(applied), float(top)
    gens, prio = upd[:, 0], upd[:, 1].view(torch.float64)
    leaf = gens % cap
    live = (gen[leaf] == gens) & (gens >= lo)
    applied = int(live.sum())
    if not applied:
        return 0, -1.0
    tree.set(leaf[live], (prio[live] + eps).pow_(alpha))
    return applied, float(prio[live].max())


def _group(index, priority, rows, counts) -> int:
    """``queue`` without the extension: the same checks and grouping in torch."""
    bad = ~torch.isfinite(priority) | (priority < 0)
    rank = torch.where(index >= 0, index >> RANK_SHIFT, -1)
    wrong = (rank < 0) | (rank >= counts.shape[0])
    if bool(bad.any()) or bool(wrong.any()):
        first_bad = int(bad.nonzero()[0]) if bool(bad.any()) else index.numel()
        first_wrong = int(wrong.nonzero()[0]) if bool(wrong.any()) else index.numel()
        return 2 * first_bad if first_bad <= first_wrong else 2 * first_wrong + 1
    order = torch.argsort(rank, stable=True)
    rows[:, 0] = (index & GEN_MASK)[order]
    rows[:, 1] = priority.view(torch.int64)[order]
    counts[:] = torch.bincount(rank, minlength=counts.shape[0]).numpy()
    return -1
