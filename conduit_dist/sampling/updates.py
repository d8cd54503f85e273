"""Priority updates between ``update_priorities`` on a learner and the shard that owns the item.

A learner's updates are checked and grouped by owner in one pass (native, or the same in torch),
then wait here: the owner's own part until its next round starts, other shards' parts until a
one-exchange round has room for them (``outgoing``); what a peer sent this shard waits
(``incoming``) for the same round start. Every list is guarded by one lock: the caller queues on
its thread, rounds take on theirs.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import torch

from conduit_dist.errors import ConfigError
from conduit_dist.records.buffers import Prefixes
from conduit_dist.records.spec import _native

RANK_SHIFT = 48  # _index = rank << 48 | generation
GEN_MASK = (1 << RANK_SHIFT) - 1


class Pairs:
    """A growable ``[k, 2]`` int64 list of queued pairs, oldest first, in one reused buffer
    (grown by doubling: a queue in steady state allocates nothing)."""

    __slots__ = ("buf", "n")

    def __init__(self, rows: int = 64) -> None:
        self.buf = torch.empty((rows, 2), dtype=torch.int64)
        self.n = 0

    def view(self) -> torch.Tensor:
        """The queued pairs (a view: valid until the next change)."""
        return self.buf[: self.n]

    def extend(self, rows: torch.Tensor) -> None:
        """Append ``rows`` (``[k, 2]`` int64, copied)."""
        k = rows.shape[0]
        if self.n + k > self.buf.shape[0]:
            grown = torch.empty((max(self.n + k, 2 * self.buf.shape[0]), 2), dtype=torch.int64)
            grown[: self.n].copy_(self.buf[: self.n])
            self.buf = grown
        self.buf[self.n : self.n + k].copy_(rows)
        self.n += k

    def drop(self, k: int) -> None:
        """Drop the ``k`` oldest pairs (the rest move to the front: a memmove)."""
        rest = self.n - k
        if rest > 0:
            ctypes.memmove(self.buf.data_ptr(), self.buf[k].data_ptr(), rest * 16)
        self.n = max(rest, 0)


class UpdateQueue:
    """Queued ``(generation, priority bits)`` int64 pairs, by owner rank, in buffers reused
    every round (:class:`Pairs`).

    Args:
        rank: this shard's rank.
        world: number of shards.
    """

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self._lock = threading.Lock()
        self._pending = [Pairs() for _ in range(world)]  # by owner
        self._received = Pairs()  # what peers sent this shard
        cpu = torch.device("cpu")
        self._rows = Prefixes(torch.int64, cpu, 128)  # queue's grouping, reused
        self._counts = np.zeros(world, dtype=np.int64)
        self._prio = Prefixes(torch.float64, cpu, 64)  # queue's float64 priorities, reused
        self._out = [Pairs() for _ in range(world)]  # outgoing's pairs, by peer
        self._own = Pairs()  # take_own's pairs

    def queue(self, index: torch.Tensor, priority: torch.Tensor) -> None:
        """Check and queue updates (contiguous CPU int64 ``[k]`` addresses and floating ``[k]``
        priorities), grouped by the shard that owns each item.

        Raises:
            ConfigError: on a NaN, infinite or negative priority, or an address of no rank
                (nothing is queued then).
        """
        world, n = self.world, index.numel()
        with self._lock:  # the grouping buffers are shared: one caller at a time
            rows, counts = self._rows.first(2 * n).view(n, 2), self._counts
            counts.fill(0)
            if priority.dtype is not torch.float64:  # converted into a reused buffer
                priority = self._prio.first(n).copy_(priority)
            if _native is not None:
                bad = _native.queue_updates(
                    index.data_ptr(), priority.data_ptr(), n, world, RANK_SHIFT,
                    rows.data_ptr(), counts.ctypes.data,
                )  # fmt: skip
            else:
                bad = _group(index, priority, rows, counts)
            if bad < 0:
                at = 0
                for owner, k in enumerate(counts.tolist()):
                    if k:
                        self._pending[owner].extend(rows[at : at + k])
                        at += k
                return
            pos = bad // 2
            got = float(priority[pos])  # read under the lock: priority may be the shared buffer
        if bad % 2 == 0:
            raise ConfigError(
                "update_priorities priority: expected finite values >= 0, got "
                f"{got} at position {pos}"
            )
        rank = int(index[pos]) >> RANK_SHIFT if int(index[pos]) >= 0 else -1
        raise ConfigError(
            "update_priorities index: expected '_index' entries of fetched batches (ranks "
            f"0..{world - 1}), got rank {rank} at position {pos}"
        )

    def outgoing(self, budgets: dict[int, int]) -> dict[int, torch.Tensor]:
        """Up to ``budgets[peer]`` queued updates per peer (``[k, 2]`` int64, oldest first; in
        a buffer reused at the next call); the rest stay queued."""
        out = {}
        with self._lock:
            for peer, budget in budgets.items():
                queued = self._pending[peer]
                k = min(budget, queued.n)
                if k <= 0:
                    continue
                box = self._out[peer]
                box.n = 0
                box.extend(queued.buf[:k])
                queued.drop(k)
                out[peer] = box.view()
        return out

    def incoming(self, rows: torch.Tensor) -> None:
        """Updates another learner sent this shard (``[k, 2]`` int64; copied)."""
        if rows.numel():
            with self._lock:
                self._received.extend(rows)

    def take_own(self) -> torch.Tensor | None:
        """Everything for this shard (received, then this rank's own), as ``[k, 2]`` rows (in
        a buffer reused at the next call)."""
        with self._lock:
            got, mine = self._received, self._pending[self.rank]
            if not got.n and not mine.n:
                return None
            own = self._own
            own.n = 0
            own.extend(got.view())
            own.extend(mine.view())
            got.n = mine.n = 0
        return own.view()

    def pending(self) -> int:
        """Updates queued here and not yet sent or applied."""
        with self._lock:
            return sum(q.n for q in self._pending)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``queued`` (``[k, 3]``: owner, generation, priority bits) and ``received``."""
        with self._lock:
            queued = [
                torch.cat([torch.full((q.n, 1), owner), q.view()], dim=1)
                for owner, q in enumerate(self._pending)
                if q.n
            ]
            received = self._received.view().clone()
        empty = torch.zeros((0, 3), dtype=torch.int64)
        return {"queued": torch.cat(queued) if queued else empty, "received": received}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict`."""
        queued = state["queued"]
        owners = torch.unique(queued[:, 0]).tolist()
        if any(not 0 <= o < self.world for o in owners):
            raise ConfigError(
                f"update queue state: expected owner ranks 0..{self.world - 1}, got {owners}"
            )
        with self._lock:
            for q in (*self._pending, self._received):
                q.n = 0
            for owner in owners:
                self._pending[owner].extend(queued[queued[:, 0] == owner, 1:])
            self._received.extend(state["received"])


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
