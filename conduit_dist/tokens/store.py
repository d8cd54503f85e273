"""One rank's shard of token experience: sequences in a token arena, grouped by prompt.

Fixed per-sequence fields live in slot-addressed columns (``capacity_items`` slots); ragged
fields in one arena per field (``capacity_tokens`` tokens), each sequence a contiguous run at
its ``offset``: no padding. Space freed by delivered or evicted sequences is reclaimed by
compacting the live runs to the front when the arena's end is reached. A group becomes
deliverable when its ``group_size`` members have arrived; when either capacity binds, the
oldest groups (by first arrival) are evicted whole and counted. Each sequence's cost
(``tokens/cost.py``) is computed here, once, and summed per group; with a token cap a put that
would give a group more tokens than one micro-batch may hold is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from conduit_dist.errors import ConfigError, SpecError
from conduit_dist.syncs import SYNCS
from conduit_dist.tiers.cuda import upload
from conduit_dist.tokens import cost as C
from conduit_dist.tokens.spec import Packed, TokenSpec

RESTORED = -(2**62)  # restored groups' keys start here (far from any generated group id)


@dataclass
class Group:
    """A prompt group on this shard: its member slots in arrival order."""

    gid: int
    first: int  # arrival sequence number of its first member (eviction order)
    slots: list[int] = field(default_factory=list)
    tokens: int = 0
    version: int = 2**62  # its oldest token's version
    complete_at: int = -1  # arrival sequence number at which it completed (-1: not yet)
    priority: float = 1.0  # prioritized replay by group
    cost: int = 0  # the sum of its members' costs (tokens/cost.py)


class GroupStore:
    """This rank's sequences and groups.

    Args:
        spec: the token spec.
        capacity_items: sequences this shard holds at most.
        capacity_tokens: tokens this shard holds at most (every ragged field alike).
        cost: what a sequence costs (``"tokens"``, ``"flops"``, a ``Flops`` or a callable
            ``L -> cost``: ``tokens/cost.py``).
        token_cap: the most tokens one micro-batch may hold (``None``: no cap); a put that
            would give a group more is refused.

    Raises:
        SpecError: if a capacity is not a positive int or a single sequence cannot fit.
        ConfigError: on a bad ``cost`` or ``token_cap``.
    """

    def __init__(
        self,
        spec: TokenSpec,
        capacity_items: int,
        capacity_tokens: int,
        cost: object = "tokens",
        token_cap: int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, v in (("capacity_items", capacity_items), ("capacity_tokens", capacity_tokens)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecError(f"{name}: expected an int >= 1, got {v!r}")
        if capacity_tokens < spec.max_len:
            raise SpecError(
                f"capacity_tokens: expected at least max_len = {spec.max_len} (one "
                f"longest sequence), got {capacity_tokens}"
            )
        if capacity_items < spec.group_size:
            raise SpecError(
                f"capacity_items: expected at least group_size = {spec.group_size}, "
                f"got {capacity_items}"
            )
        bad = isinstance(token_cap, bool) or not isinstance(token_cap, int)
        if token_cap is not None and (bad or token_cap < spec.group_size):
            raise ConfigError(
                f"token_cap: expected None or an int >= group_size = {spec.group_size} (a group "
                f"of one-token sequences), got {token_cap!r}"
            )
        self.cost = C.resolve(cost, spec.max_len, spec.group_size)
        self.token_cap = token_cap
        self.spec, self.cap_items, self.cap_tokens = spec, capacity_items, capacity_tokens
        # the columns and arenas live on ``device`` (a CUDA plane's: what producers put from
        # GPU tensors stays there); the slot metadata below is always host memory
        self.device = torch.device(device)
        dev = self.device
        self.fixed = {
            n: torch.zeros((capacity_items, *f.shape), dtype=f.dtype, device=dev)
            for n, f in spec.fixed.items()
        }
        self.arena = {
            n: torch.zeros((capacity_tokens, *f.inner), dtype=f.dtype, device=dev)
            for n, f in spec.ragged.items()
        }
        self.offset = np.zeros(capacity_items, dtype=np.int64)
        self.length = np.zeros(capacity_items, dtype=np.int64)
        self.version = np.zeros(capacity_items, dtype=np.int64)
        self.key = np.zeros(capacity_items, dtype=np.int64)  # the slot's group key
        self.free = list(range(capacity_items - 1, -1, -1))  # a stack of free slots
        self.end = 0  # arena tokens in use up to here (live or dead)
        self.live_tokens = 0
        self.groups: dict[int, Group] = {}  # gid -> Group, in arrival order
        self.arrivals = 0
        self.evicted_groups = self.evicted_sequences = 0
        self.tombstones: dict[int, int] = {}  # evicted incomplete group -> members still due

    # ------------------------------------------------------------------ adding

    def add(self, p: Packed, keys: torch.Tensor | None = None) -> None:
        """Store a checked batch whole (groups' member counts checked first).

        Args:
            p: the checked batch.
            keys: per-sequence group keys (default: the group field; a restore gives groups
                fresh keys, since ids only need to be new on the rank that generated them).

        Raises:
            SpecError: a group would exceed ``group_size`` members or ``token_cap`` tokens (then
                the put's reserved groups are dropped, and that group's stored members too, as
                for an evicted group), a sequence's cost is not valid, or the batch alone exceeds
                a capacity; nothing is stored.
        """
        gids = (p.fixed[self.spec.group] if keys is None else keys).tolist()
        if self.tombstones and any(g in self.tombstones for g in gids):
            p, gids = self._drop_evicted(p, gids)
            if p is None:
                return
        counts: dict[int, int] = {}
        for g in gids:
            counts[g] = counts.get(g, 0) + 1
        for g, c in counts.items():
            have = len(self.groups[g].slots) if g in self.groups else 0
            if have + c > self.spec.group_size:
                raise SpecError(
                    f"group {g}: expected at most group_size = {self.spec.group_size}"
                    f" members, got {have} stored + {c} in this put"
                )
        lengths = p.lengths.numpy()
        self._check_cap(gids, lengths)
        costs = self.cost(lengths)
        total = int(p.lengths.sum())
        if p.n > self.cap_items or total > self.cap_tokens:
            raise SpecError(
                f"put: {p.n} sequences / {total} tokens exceed this shard's capacity "
                f"({self.cap_items} / {self.cap_tokens}); put fewer at a time"
            )
        self._make_room(p.n, total, set(counts))
        if self.end + total > self.cap_tokens:
            self._compact()
        starts = self.end + np.concatenate(([0], np.cumsum(lengths)[:-1]))
        slots = [self.free.pop() for _ in range(p.n)]
        idx = upload(torch.as_tensor(slots), self.device)
        for n, col in self.fixed.items():  # (between devices: one copy each)
            col[idx] = self._placed(p.fixed[n])
        for n, arena in self.arena.items():
            arena[self.end : self.end + total] = self._placed(p.ragged[n])
        self.offset[slots], self.length[slots] = starts, lengths
        self.version[slots] = p.versions.numpy()
        self.key[slots] = gids
        self.end += total
        self.live_tokens += total
        for i, (s, g) in enumerate(zip(slots, gids, strict=True)):
            grp = self.groups.get(g)
            if grp is None:
                grp = self.groups[g] = Group(g, self.arrivals)
            grp.slots.append(s)
            grp.tokens += int(lengths[i])
            grp.cost += int(costs[i])
            grp.version = min(grp.version, int(self.version[s]))
            self.arrivals += 1
            if len(grp.slots) == self.spec.group_size:
                grp.complete_at = self.arrivals

    def _placed(self, t: torch.Tensor) -> torch.Tensor:
        """A put column on the store's device: there already (a GPU producer's tokens on a CUDA
        plane), uploaded without a host sync (host to CUDA), or read to a host store (CUDA to
        the host: a counted sync)."""
        if t.is_cuda and self.device.type != "cuda":
            SYNCS.add("token put to a host store")
        return upload(t, self.device)

    def _check_cap(self, gids: list[int], lengths: np.ndarray) -> None:
        """Refuse a put that would give a group more than ``token_cap`` tokens (see :meth:`add`)."""
        if self.token_cap is None:
            return
        put: dict[int, int] = {}
        for g, n in zip(gids, lengths.tolist(), strict=True):
            put[g] = put.get(g, 0) + n
        for g, n in put.items():
            grp = self.groups.get(g)
            have = grp.tokens if grp is not None else 0
            if have + n <= self.token_cap:
                continue
            stored = len(grp.slots) if grp is not None else 0
            self.cancel(list(put))  # reservations that will not arrive hold no place
            if stored:  # it can never be delivered: evicted, its later members dropped
                self.evicted_groups += 1
                self.evicted_sequences += stored
                self.evict([g])
            raise SpecError(
                f"group {g}: {have + n} tokens ({have} stored + {n} in this put) exceed "
                f"token_cap = {self.token_cap}, the most one micro-batch may hold (a group is "
                "never split); nothing of this put is stored"
                + (f", and its {stored} stored members are dropped" if stored else "")
            )

    def _make_room(self, n: int, tokens: int, keep: set[int]) -> None:
        """Evict the oldest groups by first arrival (not those the batch adds to, when others
        exist), until ``n`` slots and ``tokens`` arena tokens are
        free. An evicted incomplete group's later members are dropped when they arrive (and
        counted), so they never start a group that cannot complete."""
        while len(self.free) < n or self.live_tokens + tokens > self.cap_tokens:
            held = [g for g, grp in self.groups.items() if grp.slots]
            victim = next((g for g in held if g not in keep), held[0])
            if victim in keep:
                raise SpecError(
                    f"group {victim}: its members exceed this shard's capacity "
                    f"({self.cap_items} sequences / {self.cap_tokens} tokens); "
                    "raise tokens_per_rank or capacity_per_rank"
                )
            self.evicted_groups += 1
            self.evicted_sequences += len(self.groups[victim].slots)
            self.evict([victim])

    def evict(self, gids: list[int]) -> None:
        """Drop groups without delivering them; late members of incomplete ones are dropped
        when they arrive (and counted) instead of starting a group that cannot complete."""
        for g in gids:
            grp = self.groups[g]
            if grp.complete_at < 0 and len(grp.slots) < self.spec.group_size:
                self.tombstones[g] = self.spec.group_size - len(grp.slots)
        self.remove(gids)

    def _drop_evicted(self, p: Packed, gids: list[int]) -> tuple[Packed | None, list[int]]:
        """``p`` without the members of groups evicted before they completed (counted)."""
        keep = []
        for g in gids:
            left = self.tombstones.get(g, 0)
            keep.append(left == 0)
            if left:
                self.evicted_sequences += 1
                if left == 1:
                    del self.tombstones[g]
                else:
                    self.tombstones[g] = left - 1
        mask = torch.tensor(keep, dtype=torch.bool)
        if not mask.any():
            return None, []
        rows = mask.nonzero().flatten()  # indices built on the host: no device read
        tok = torch.repeat_interleave(mask, p.lengths).nonzero().flatten()

        def pick(t: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
            return t.index_select(0, upload(i, t.device))

        kept = Packed(
            {n: pick(c, rows) for n, c in p.fixed.items()},
            {n: pick(v, tok) for n, v in p.ragged.items()},
            p.lengths[mask],
            p.versions[mask],
        )
        return kept, [g for g, k in zip(gids, keep, strict=True) if k]

    def _compact(self) -> None:
        """Move every live sequence's tokens to the front of the arena, in arrival order."""
        slots = [s for g in self.groups.values() for s in g.slots]
        idx = upload(self.token_index(slots), self.device)
        for arena in self.arena.values():
            arena[: idx.numel()] = arena[idx]
        lengths = self.length[slots]
        self.offset[slots] = np.concatenate(([0], np.cumsum(lengths)[:-1])) if slots else []
        self.end = int(lengths.sum())

    def reserve(self, gids: list[int], version: int) -> None:
        """Register groups about to be generated with ``version`` (pacing: rounds keep room
        for them in the global batch that must take them).

        Raises:
            SpecError: if a group id is already stored or reserved.
        """
        dup = [g for g in gids if g in self.groups]
        if dup or len(set(gids)) != len(gids):
            raise SpecError(
                f"reserve: group ids must be new on this rank, got {dup or gids} "
                "already stored or repeated"
            )
        for g in gids:
            self.tombstones.pop(g, None)  # a reused id starts afresh
            self.groups[g] = Group(g, self.arrivals, version=int(version))

    def cancel(self, gids: list[int]) -> None:
        """Drop the reservations among ``gids`` that no member has reached yet."""
        self.remove([g for g in set(gids) if g in self.groups and not self.groups[g].slots])

    # ------------------------------------------------------------------ reading

    def token_index(self, slots: list[int] | np.ndarray) -> torch.Tensor:
        """Arena positions of the tokens of ``slots``, in order."""
        if len(slots) == 0:
            return torch.zeros(0, dtype=torch.int64)
        lengths = torch.as_tensor(self.length[slots])
        starts = torch.as_tensor(self.offset[slots])
        base = torch.repeat_interleave(starts - (torch.cumsum(lengths, 0) - lengths), lengths)
        return base + torch.arange(int(lengths.sum()))

    def complete(self) -> list[Group]:
        """Complete groups, in completion order."""
        return sorted(
            (g for g in self.groups.values() if g.complete_at >= 0), key=lambda g: g.complete_at
        )

    def incomplete(self) -> list[Group]:
        """Groups still waiting for members."""
        return [g for g in self.groups.values() if g.complete_at < 0]

    def remove(self, gids: list[int]) -> None:
        """Drop groups (delivered once, or evicted); their slots and tokens become free."""
        slots: list[int] = []
        for g in gids:
            slots += self.groups.pop(g).slots
        self.free.extend(slots)
        if slots:  # one sum for all of them (a round removes hundreds of groups)
            self.live_tokens -= int(self.length[slots].sum())

    @property
    def sequences(self) -> int:
        """Sequences stored."""
        return self.cap_items - len(self.free)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, object]:
        """Every live sequence, grouped, as plain tensors (loads with ``weights_only=True``)."""
        order = [s for g in self.groups.values() for s in g.slots]
        idx = torch.as_tensor(order, dtype=torch.int64).to(self.device)
        tok = self.token_index(order).to(self.device)
        return {  # host tensors, whatever the arenas' device: a checkpoint loads them anywhere
            "fixed": {n: c[idx].cpu() for n, c in self.fixed.items()},
            "ragged": {n: a[tok].cpu() for n, a in self.arena.items()},
            "lengths": torch.as_tensor(self.length[order]),
            "versions": torch.as_tensor(self.version[order]),
            "keys": torch.as_tensor(self.key[order]),  # groups contiguous, one key each
            "priority": torch.tensor(
                [self.groups[int(k)].priority for k in self.key[order]], dtype=torch.float64
            ),
            "evicted": torch.tensor([self.evicted_groups, self.evicted_sequences]),
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Replace this shard's content by ``state`` (as :meth:`state_dict` gives)."""
        self.remove(list(self.groups))
        self.end, self.arrivals = 0, 0
        gid = state["keys"]
        if int(gid.shape[0]):  # groups are contiguous: a new key where the key changes
            change = torch.ones_like(gid, dtype=torch.bool)
            change[1:] = gid[1:] != gid[:-1]
            keys = RESTORED + torch.cumsum(change.long(), 0) - 1
            p = Packed(state["fixed"], state["ragged"], state["lengths"], state["versions"])
            self.add(p, keys)
            prio = state.get("priority")
            if prio is not None:  # replay priorities survive a checkpoint
                for k, v in zip(keys[change].tolist(), prio[change].tolist(), strict=True):
                    self.groups[k].priority = float(v)
        self.evicted_groups, self.evicted_sequences = (int(x) for x in state["evicted"])
