"""``round_robin`` placement: shards fill evenly, whoever puts."""

from __future__ import annotations

import numpy as np

from conduit_dist.placement.base import Placement


def spread(staged: np.ndarray, offset: int) -> np.ndarray:
    """Each rank spreads its items over all shards in contiguous, near-equal blocks.

    The remainders are dealt one by one, globally, starting at shard ``offset % world``, so shard
    sizes never differ by more than one item.

    Args:
        staged: ``[world]`` items staged on each rank.
        offset: items dealt as remainders in earlier rounds (rotates where remainders go).

    Returns:
        ``int64 [world, world]`` item counts from each source to each destination.
    """
    world = staged.shape[0]
    plan = np.repeat((staged // world)[:, None], world, axis=1).astype(np.int64)
    rem = staged % world
    starts = offset + np.concatenate([[0], np.cumsum(rem)[:-1]])
    for src in np.nonzero(rem)[0]:
        plan[src, (starts[src] + np.arange(rem[src])) % world] += 1
    return plan


class RoundRobin(Placement):
    """Spread every rank's items over all shards (see :func:`spread`); plans are memoised.
    Items of samplers that keep streams together are dealt by stream (:meth:`route`)."""

    name = "round_robin"

    def __init__(self) -> None:
        self.dealt = 0  # remainder items dealt so far (the same on every rank)
        self._memo: dict[bytes, np.ndarray] = {}

    def peek(self, staged: np.ndarray) -> np.ndarray:
        """This round's plan without advancing the remainder position."""
        world = staged.shape[0]
        key = staged.tobytes() + (self.dealt % world).to_bytes(4, "little")
        plan = self._memo.get(key)
        if plan is None:  # steady-state rounds repeat the same counts and offset
            plan = spread(staged, self.dealt)
            if len(self._memo) > 1024:
                self._memo.clear()
            self._memo[key] = plan
        return plan

    def advance(self, staged: np.ndarray) -> None:
        """Move the remainder position past this round's remainders."""
        self.dealt += int((staged % staged.shape[0]).sum())

    def plan(
        self, staged: np.ndarray, requests: np.ndarray, sizes: np.ndarray, capacity: int
    ) -> np.ndarray:
        """:func:`spread` from the current remainder position, then advance it."""
        plan = self.peek(staged)
        self.advance(staged)
        return plan

    def route(self, src: int, keys: np.ndarray) -> np.ndarray:
        """Streams dealt over the shards: key ``k`` of rank ``src`` goes to ``(src + k) %
        world`` (every shard gets an equal share of each rank's streams when a rank has a
        multiple of ``world`` of them; streams of different ranks that share a shard have
        different keys)."""
        return (src + keys.astype(np.int64)) % self.ctx.world

    def state_dict(self) -> dict[str, object]:
        """The remainder position."""
        return {"dealt": self.dealt}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore the remainder position."""
        self.dealt = int(state["dealt"])
