"""Uniform sampling without replacement: epochs over a snapshot of the global store.

A *pass* starts at the first round in which a learner fetches while none is running: it covers
the items stored on every shard at that round (after its ingestion), numbered in shard-rank
order, and is split into one contiguous block per learner that fetches in that round (a
colocated learner over ``local`` placement with equal shards gets its own shard's items: no
item crosses a link). Each learner's stream is ``epochs`` permutations of its block, drawn from
``(seed, pass, epoch, learner)`` on every rank alike (``shuffle="local"``); ``shuffle="global"``
permutes the whole pass each epoch and deals it out in blocks (an item may go to another learner
each epoch: the measured cost is in ``bench ppo``). Every fetch takes the next ``batch_size``
positions of its learner's stream, all or nothing, and never spans two epochs (an epoch's last
positions, fewer than asked or too many of them overwritten, are dropped and counted, as
``drop_last`` does, and the fetch is served from the next epoch); a learner whose stream is done
gets nothing (its fetch raises ``EmptyStoreError``) until every learner's is, when the pass
ends. A pass of which nothing could be delivered (every fetch larger than an epoch of its
learner's block) ends without taking anything; the next starts over what is stored then.

``epochs=k``: the pass's items leave the store when it ends (a PPO rollout: each item to one
learner, ``k`` times, then gone). ``epochs=None``: one epoch per pass and nothing is taken
(replay without replacement); an item the ring overwrites before its turn is skipped and
counted (``store_stats()["skipped"]``), never replaced by another.

Every rank tracks every shard's oldest generation from the replicated sizes and inflows
(``ingested``), so the allocation needs no exchange of its own.
"""

from __future__ import annotations

import numpy as np
import torch

from conduit_dist.errors import ConfigError
from conduit_dist.sampling.base import Sampler, Takes, TracksInflow, mix, proportional

SHUFFLES = ("local", "global")  # also algo.ppo.shuffle's values (registry.SHUFFLES)


class WithoutReplacement(Takes, TracksInflow, Sampler):
    """Epochs over a snapshot of the global store, each item once per epoch.

    Args:
        epochs: passes over each snapshot before its items leave the store (``None``: one
            epoch per snapshot, and items stay).
        shuffle: ``local`` (each learner permutes its own block) or ``global`` (the whole
            snapshot is permuted each epoch, then dealt out).

    Raises:
        ConfigError: on ``epochs`` below 1 or an unknown ``shuffle``.
    """

    name = "without_replacement"

    def __init__(self, epochs: int | None = None, shuffle: str = "local") -> None:
        super().__init__()
        if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int)):
            raise ConfigError(f"WithoutReplacement epochs: expected an int or None, got {epochs!r}")
        if epochs is not None and epochs < 1:
            raise ConfigError(f"WithoutReplacement epochs: expected >= 1 or None, got {epochs}")
        if shuffle not in SHUFFLES:
            raise ConfigError(
                f"WithoutReplacement shuffle: expected one of {list(SHUFFLES)}, got {shuffle!r}"
            )
        self.epochs, self.shuffle = epochs, shuffle
        self.passes = 0  # passes started
        self.skipped = 0  # items of a pass the ring overwrote before their turn
        self.dropped = 0  # an epoch's last positions, fewer than a fetch asked (drop_last)
        self._end: np.ndarray | None = None  # [world] generations ingested per shard
        self._pass: dict[str, np.ndarray] | None = None
        self._mine = torch.empty(0, dtype=torch.int64)  # this shard's draws, learner order
        self._orders: dict[int, tuple[tuple[int, int], np.ndarray]] = {}  # learner: its epoch

    def bind(self, ctx) -> None:
        """Attach to a plane; every shard starts at generation 0."""
        super().bind(ctx)
        self._end = np.zeros(ctx.world, dtype=np.int64)

    def ingested(self, inflow: np.ndarray) -> None:
        """Items each shard took in this round (replicated)."""
        self._end += inflow.astype(np.int64)

    def expected(self, requests: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """Size-proportional (the mean over passes)."""
        return proportional(requests, sizes)

    def _start(self, requests: np.ndarray, sizes: np.ndarray) -> None:
        learners = np.flatnonzero(requests > 0)
        n = sizes.astype(np.int64).copy()
        total, k = int(n.sum()), len(learners)
        bounds = np.array([total * i // k for i in range(k + 1)], dtype=np.int64)
        epochs = self.epochs or 1
        self._pass = {
            "first": self._end - n,  # each shard's oldest generation at the start
            "count": n,
            "learners": learners,
            "bounds": bounds,
            "cursor": np.zeros(k, dtype=np.int64),
            "length": (bounds[1:] - bounds[:-1]) * epochs,
            "id": np.array([self.passes]),
            "delivered": np.zeros(1, dtype=np.int64),
        }
        self.passes += 1

    def _order(self, i: int, epoch: int) -> np.ndarray:
        """Global positions of learner ``i``'s block in ``epoch``'s order (kept per learner
        while its fetches walk the epoch)."""
        p = self._pass
        key = (int(p["id"][0]), epoch)
        hit = self._orders.get(i)
        if hit is not None and hit[0] == key:
            return hit[1]
        b0, b1 = int(p["bounds"][i]), int(p["bounds"][i + 1])
        seed = mix(self.ctx.seed, key[0], epoch, i if self.shuffle == "local" else -1)
        rng = np.random.Generator(np.random.PCG64(seed))
        if self.shuffle == "local":
            order = b0 + rng.permutation(b1 - b0)
        else:
            order = rng.permutation(int(p["count"].sum()))[b0:b1]
        self._orders[i] = (key, order)
        return order

    def allocate(
        self, requests: np.ndarray, sizes: np.ndarray, round: int, meta: np.ndarray
    ) -> np.ndarray:
        """The next positions of every fetching learner's stream, all or nothing."""
        world = sizes.shape[0]
        counts = np.zeros((world, world), dtype=np.int64)
        self._taken = None
        if self._pass is None:
            if not (requests > 0).any() or not sizes.any():
                return counts
            self._start(requests, sizes)
        p = self._pass
        oldest = self._end - sizes  # every shard's oldest generation now
        offsets = np.concatenate([[0], np.cumsum(p["count"])])
        mine: list[np.ndarray] = []
        for learner in range(world):
            want = int(requests[learner])
            hit = np.flatnonzero(p["learners"] == learner)
            if want <= 0 or not hit.size:
                continue
            i = int(hit[0])
            got = self._next(i, want, offsets, oldest)
            if got is None:  # nothing left in its stream that fills the fetch
                continue
            gens, shards = got
            gen, shard = np.concatenate(gens), np.concatenate(shards)
            counts[learner] = np.bincount(shard, minlength=world)
            mine.append(gen[shard == self.ctx.rank])
            p["delivered"][0] += gen.size
        self._mine = torch.from_numpy(np.concatenate(mine) if mine else np.zeros(0, np.int64))
        if (p["cursor"] >= p["length"]).all():  # the pass is over
            # its live items (the oldest) leave the store, unless nothing of it was delivered
            # (every learner asked for more than one epoch of its block holds)
            if self.epochs is not None and p["delivered"][0]:
                self._taken = np.maximum(p["first"] + p["count"] - oldest, 0)
            self._pass = None
        return counts

    def _next(self, i: int, want: int, offsets: np.ndarray, oldest: np.ndarray):
        """Learner ``i``'s next ``want`` live items from one epoch of its stream, as
        ``(generations, shards)`` lists, advancing its cursor; an epoch's tail that cannot fill
        the fetch (too few positions, or too many overwritten) is dropped and counted, and the
        next epoch is tried; ``None`` once the stream is over."""
        p = self._pass
        cur, end = int(p["cursor"][i]), int(p["length"][i])
        block = int(p["bounds"][i + 1] - p["bounds"][i])
        got = None
        while block and cur < end and got is None:
            e_end = min((cur // block + 1) * block, end)
            if e_end - cur < want:  # a batch never spans two epochs: the tail is dropped
                self.dropped += e_end - cur
                cur = e_end
                continue
            gens, shards, need, c = [], [], want, cur
            order, e0 = self._order(i, cur // block), cur // block * block
            while need and c < e_end:  # skip items the ring overwrote, never replace them
                pos = order[c - e0 : min(c + need, e_end) - e0]
                shard = np.searchsorted(offsets, pos, side="right") - 1
                gen = p["first"][shard] + (pos - offsets[shard])
                live = gen >= oldest[shard]
                c += pos.size
                self.skipped += int((~live).sum())
                gens.append(gen[live])
                shards.append(shard[live])
                need -= int(live.sum())
            if need:  # overwritten items left the tail short: its live ones are dropped
                self.dropped += want - need
            else:
                got = gens, shards
            cur = c
        if got is not None and 0 < end - cur < want:  # the last epoch's tail: a fetch of the
            self.dropped += end - cur  # same size cannot be served, so the stream ends now
            cur = end
        p["cursor"][i] = end if not block else cur
        return got

    def taken(self, counts: np.ndarray) -> np.ndarray | None:
        """``[world]`` items each shard gives up this round: a finished pass's (``epochs``)."""
        return self._taken

    def empty_reason(self, batch_size: int, stored: int) -> str:
        """A learner's stream is done, or holds fewer than asked."""
        return (
            f"fewer than {batch_size} positions are left in this learner's stream of pass "
            f"{self.passes - 1} ({self.epochs or 1} epoch(s) over its block; {stored} items "
            "stored); a new pass starts once every learner's stream is done; nothing was taken "
            "for this fetch"
        )

    def draw(self, count: int, round: int, stream: int = 0) -> torch.Tensor:
        """This shard's generations of the round, learner by learner."""
        return self._mine[:count]

    def stats(self) -> dict[str, int]:
        """Passes started, items skipped (overwritten before their turn) and dropped (an
        epoch's last positions, fewer than a fetch asked for)."""
        return {"passes": self.passes, "skipped": self.skipped, "dropped": self.dropped}

    def state_dict(self) -> dict[str, object]:
        """Generation counters and the running pass (tensors)."""
        out: dict[str, object] = {
            "name": self.name,
            "end": torch.from_numpy(self._end.copy()),
            "passes": self.passes,
            "skipped": self.skipped,
            "dropped": self.dropped,
        }
        if self._pass is not None:
            out["pass"] = {k: torch.from_numpy(v.copy()) for k, v in self._pass.items()}
        return out

    def restore_state(self, states, exact, rank, written) -> None:
        """Same world size: the saved pass goes on. Otherwise the items were redealt: the pass
        that was running starts again over the restored store (counted in ``passes``)."""
        if exact:
            self.load_state_dict(states[rank])
            return
        super().load_state_dict(states[0])
        self._end = written.astype(np.int64).copy()
        self._pass, self._orders = None, {}
        self.passes = int(states[0]["passes"])
        self.skipped, self.dropped = int(states[0]["skipped"]), int(states[0]["dropped"])

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict`."""
        super().load_state_dict(state)
        self._end = state["end"].numpy().astype(np.int64).copy()
        self.passes, self.skipped = int(state["passes"]), int(state["skipped"])
        self.dropped = int(state["dropped"])
        got = state.get("pass")
        self._pass = None if got is None else {k: v.numpy().copy() for k, v in got.items()}
