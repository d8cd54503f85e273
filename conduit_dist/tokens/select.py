"""Which complete groups a token round delivers: the same decision on every rank, from the
round's replicated group table.

Consume-once (on-policy): the oldest policy versions first, then completion order; groups at
the age bound (``version <= newest - max_policy_age``) must all be in this global batch, so
room is kept for those still being generated. Replay: ``want`` distinct groups drawn uniformly,
or in proportion to ``priority ** alpha``, from every complete group; the store keeps them.
A streamed piece leaves either nothing or at least one group per learner for later pieces;
with a token cap it is also a multiple of the learner count (:func:`planned`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from conduit_dist.tokens import balance

# columns of a rank's group table (int64; priority as float64 bits; COST: the sum of the
# members' integer costs, computed by their holder at put: tokens/cost.py)
GID, TOKENS, MEMBERS, VERSION, ORDER, PRIORITY, COST = range(7)
WIDTH = 7
EPS = 1e-6  # added to priorities, as the plane's prioritized sampler does
PENDING = -1  # ORDER of a group still waiting for members
UPDATE = -2  # ORDER of a row that carries a priority update (GID, holder in TOKENS, PRIORITY)


@dataclass
class Groups:
    """Every rank's groups, concatenated (rank-major)."""

    rank: np.ndarray
    table: np.ndarray  # [n, WIDTH]

    @property
    def complete(self) -> np.ndarray:
        return self.table[:, ORDER] >= 0

    @property
    def version(self) -> np.ndarray:
        return self.table[:, VERSION]

    @property
    def tokens(self) -> np.ndarray:
        return self.table[:, TOKENS]

    @property
    def cost(self) -> np.ndarray:
        return self.table[:, COST]


def gather_tables(tables: np.ndarray, rows: np.ndarray) -> tuple[Groups, np.ndarray]:
    """Split the gathered ``[world, >= max_rows * WIDTH]`` tables into groups and update rows."""
    world = tables.shape[0]
    parts = [tables[r, : rows[r] * WIDTH].reshape(-1, WIDTH) for r in range(world)]
    table = np.concatenate(parts) if parts else np.zeros((0, WIDTH), np.int64)
    rank = np.repeat(np.arange(world), rows)
    upd = table[:, ORDER] == UPDATE
    return Groups(rank[~upd], table[~upd]), table[upd]


def stale(groups: Groups, newest: int, max_age: int | None) -> np.ndarray:
    """Groups already older than the bound, complete or still arriving: they can never be
    delivered, so they are evicted (none when producers pace with ``reserve`` and learners
    publish one version per global batch)."""
    if max_age is None:
        return np.zeros(len(groups.rank), dtype=bool)
    return groups.version < newest - max_age


def consume(
    groups: Groups,
    want: int,
    learners: int,
    min_piece: int,
    newest: int,
    max_age: int | None,
    skip: np.ndarray,
) -> np.ndarray:
    """Indices (into ``groups``) of this round's consume-once piece, in delivery order."""
    ok = groups.complete & ~skip
    order = np.lexsort((groups.rank, groups.table[:, ORDER], groups.version))
    cand = order[ok[order]]
    waiting = 0
    if max_age is not None:  # groups at the bound still generating: keep room for them
        at_bound = (groups.version <= newest - max_age) & ~groups.complete
        waiting = int(at_bound.sum())
    k = min(len(cand), want - waiting)
    return cand[: piece(k, want, learners, min_piece)]


def piece(k: int, want: int, learners: int, min_piece: int) -> int:
    """The largest deliverable piece <= ``k``: all that is wanted, or one that leaves at least
    one group per learner and is at least ``min_piece`` (else 0: wait for more)."""
    if k >= want:
        return want
    k = min(k, want - learners)
    return k if k >= max(min_piece, learners) else 0


def replay(
    groups: Groups, want: int, rng: np.random.Generator, alpha: float | None, skip: np.ndarray
) -> np.ndarray:
    """``want`` distinct complete groups, uniformly or by ``priority ** alpha`` (none when fewer
    are stored)."""
    cand = np.flatnonzero(groups.complete & ~skip)
    if len(cand) < want:
        return cand[:0]
    if alpha is None:
        return rng.choice(cand, size=want, replace=False)
    p = (groups.table[cand, PRIORITY].view(np.float64) + EPS) ** alpha  # zero stays drawable
    return rng.choice(cand, size=want, replace=False, p=p / p.sum())


def planned(
    groups: Groups, chosen: np.ndarray, want: int, learners: int, budget: int, cap: int | None
) -> tuple[np.ndarray, list[list[list[int]]]]:
    """The piece that is delivered and its plan (:func:`conduit_dist.tokens.balance.plan`):
    balanced by the groups' costs, micro-batches sized by ``budget`` and never over ``cap``.

    With a cap, a streamed piece short of the ``want`` groups still wanted is cut to a multiple
    of ``learners`` (the groups left wait for the next piece, oldest first): with ``num_groups``
    a multiple of the learners every piece then has a plan within the cap.

    Raises:
        ConfigError: ``budget > cap``, or no plan within the cap (see ``balance.plan``).
    """
    if cap is not None and len(chosen) < want:
        chosen = chosen[: len(chosen) - len(chosen) % learners]
    costs = groups.cost[chosen].tolist()
    return chosen, balance.plan(groups.tokens[chosen].tolist(), learners, budget, costs, cap)
