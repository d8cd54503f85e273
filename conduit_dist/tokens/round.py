"""One token round: every rank's group table in one all-gather, the same selection and
cost-balanced plan on every rank, then the selected groups' sequences in one exchange from
their holders to their learners, without padding.

Steps (each rank, in the same order):

1. ``meta``: a fixed row (table rows, the learners' request, each learner's version and
   weights size, closing, whether a round was launched ahead of the next version, whether the
   rank loads whole weights) and this rank's group table (complete groups, groups still
   generating, priority updates; a group's tokens and its integer cost), all-gathered.
2. ``weights``: a newer version, each learner's part sent to the ranks that load it
   (``flow/weights.py``).
3. ``select``: stale groups evicted (none when producers pace with ``reserve`` and
   learners publish one version per global batch), then the piece
   (``tokens/select.py``), identical everywhere.
4. ``plan``: the piece over the learners by cost (``cost``: tokens, flops or a callable), each
   share into micro-batches never over ``token_cap`` tokens (``tokens/balance.py``,
   ``tokens/deal.py``).
5. ``deliver``: holders pack their selected groups per learner (``tokens/wire.py``); one
   exchange whose byte matrix every rank derived from the tables; learners cut micro-batches.
6. ``take``: consume-once groups leave their holders.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from conduit_dist.errors import ConfigError, StaleDataError
from conduit_dist.tokens import deliver as D
from conduit_dist.tokens import select as S
from conduit_dist.tokens.batch import MicroBatch
from conduit_dist.tokens.store import GroupStore
from conduit_dist.tokens.wire import Wire

# meta row columns (AHEAD: the first learner's round was launched ahead of its next version;
# WHEAD: a learner's weights header's digest, device weights; WHOLE: the rank loads whole
# weights, a producer or a learner serving an ingress)
ROWS, WANT, BUDGET, MIN_PIECE, VERSION, WBYTES, CLOSING, AHEAD, WHEAD, WHOLE, WSLOT = range(11)
WSHARD = 11  # a learner's sharded (FSDP2) weights: its header's bytes (0: not sharded)
# the weights versions the rank reads in place from learners' files: held whole, being pulled,
# the oldest and newest its modules view (0: none)
WHELD, WPULL, WVIEW, WVIEWHI = 12, 13, 14, 15
META_WIDTH = 16


@dataclass
class Request:
    """What a rank asks of a round (learners: the same on every learner)."""

    want: int = 0  # groups still wanted for the global batch (0: none, a producer's flush)
    budget: int = 0  # tokens per micro-batch
    min_piece: int = 0  # the smallest piece worth delivering (streaming: one per learner)
    closing: bool = False


@dataclass
class TokenRoundStats:
    """What a round did (the same on every rank except the byte and time fields)."""

    round: int
    groups: int = 0  # delivered in this round, to every learner together
    newest: int = 0  # the first learner's version
    oldest_delivered: int = -1  # the oldest version among delivered sequences (-1: none)
    wire_bytes: int = 0  # bytes this rank received
    token_bytes: int = 0  # of which sequence data (fields, lengths, versions) without padding
    stale_evicted: int = 0  # groups this rank evicted as too old
    closing_rank: int = -1  # a rank that closed the plane in this round
    ms: float = 0.0


class TokenRound:
    """Runs a token plane's rounds (see the module docstring).

    Args:
        store: this rank's shard.
        ex: the plane's collectives; transport: the strategy per exchange.
        learners: the learner ranks; the first publishes versions and weights.
        max_age: ``max_policy_age`` (``None``: no bound).
        replay: ``None`` (consume once), ``"uniform"`` or ``"prioritized"``.
        alpha: the priority exponent of prioritized replay.
        seed: the replay draw's seed (the same on every rank).
        device: where micro-batches are delivered.
        token_cap: the most tokens a micro-batch may hold (``None``: no cap; see
            ``select.planned``).
        rehearse: run the device path's exchange of lengths on a CPU plane (its rehearsal,
            ``rounds.devices.REHEARSAL_ENV``).
    """

    def __init__(
        self,
        store: GroupStore,
        ex,
        transport,
        learners: tuple[int, ...],
        max_age: int | None,
        replay: str | None,
        alpha: float,
        seed: int,
        device: torch.device,
        token_cap: int | None = None,
        rehearse: bool = False,
    ) -> None:
        self.store, self.ex, self.transport = store, ex, transport
        self.token_cap = token_cap
        self.wire = Wire(store.spec)
        self.learners, self.max_age, self.replay = learners, max_age, replay
        self.alpha, self.seed, self.device = alpha, seed, device
        self.round = 0
        # sections on a device (or the device path rehearsed): their lengths go on the host
        self.lengths_on_host = store.device.type != "cpu" or rehearse
        self.on_enqueued = None  # set by a round launched at a backward (plane.py)
        self.on_delivered = None  # an open ingress's ledger: (gids held here, removed)
        self.serves = False  # an open ingress: this learner loads whole weights too
        self.rows_hint = 16  # table rows the meta all-gather carries (see _gather)
        self.stale_evicted = 0
        self.updates: list[tuple[int, int, float]] = []  # (holder, gid, priority) to send
        self._bufs: dict[str, torch.Tensor] = {}  # the sections' send and receive bytes

    def _buffer(self, name: str, nbytes: int) -> torch.Tensor:
        """The reused byte buffer ``name`` (the sections' send or receive bytes, on the arenas'
        device), grown by a quarter beyond ``nbytes`` when too small (a host buffer reused is
        not page-faulted in again every round). A round is done with both before the next
        starts: the cut copies what it keeps, and on a device the round's stream waits for its
        exchange's works before the cut, so the next round's pack is ordered after them."""
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(
                nbytes + nbytes // 4 + 64, dtype=torch.uint8, device=self.store.device
            )
            self._bufs[name] = buf
        return buf[:nbytes]

    # ------------------------------------------------------------------ meta

    def _table(self) -> np.ndarray:
        groups = self.store.groups.values()
        ints = [(g.gid, g.tokens, len(g.slots), g.version, g.complete_at, g.cost) for g in groups]
        ints += [(gid, holder, 0, 0, S.UPDATE, 0) for holder, gid, _ in self.updates]
        prio = [g.priority for g in groups] + [p for _, _, p in self.updates]
        self.updates = []
        t = np.zeros((len(ints), S.WIDTH), dtype=np.int64)
        if ints:  # priorities travel as their float64 bits
            cols = [c for c in range(S.WIDTH) if c != S.PRIORITY]
            t[:, cols] = np.array(ints, dtype=np.int64)
            t[:, S.PRIORITY] = np.array(prio, dtype=np.float64).view(np.int64)
        return t  # a group not complete yet has ORDER -1 = select.PENDING

    def _gather(self, req: Request, weights, version: int, snap, ahead: bool):
        """Every rank's meta row and group table: one all-gather carrying the meta and up to
        ``rows_hint`` table rows (the largest table of the last round, rounded up to a power of
        two), a second one only for the rows beyond it."""
        table = self._table()
        k, w = self.rows_hint, S.WIDTH
        row = torch.zeros(META_WIDTH + k * w, dtype=torch.int64)
        row[ROWS], row[WANT], row[BUDGET] = len(table), req.want, req.budget
        row[MIN_PIECE], row[CLOSING] = req.min_piece, int(req.closing)
        if self.ex.rank in self.learners:
            row[VERSION], row[AHEAD] = version, int(ahead)
            fresh = snap.buf is not None and snap.version > weights.broadcast
            row[WBYTES], row[WHEAD] = (snap.nbytes, snap.head) if fresh else (0, 0)
            row[WSHARD] = snap.shard_head if fresh else 0
            row[WSLOT] = snap.slot
        row[WHOLE] = int(self.ex.rank not in self.learners or self.serves)
        if weights.files is not None:
            row[WHELD], row[WPULL], row[WVIEW], row[WVIEWHI] = weights.held()
        head = table[:k].reshape(-1)
        row[META_WIDTH : META_WIDTH + head.size] = torch.from_numpy(head)
        got = self.ex.all_gather_start(row, self.round).wait().numpy().copy()
        if weights.files is not None:  # every rank finished the rounds before this one
            held = got[:, [WHELD, WPULL]]
            views = got[:, [WVIEW, WVIEWHI]]
            weights.files.gathered_at(
                self.round, {int(v) for v in held[held > 0]},
                [(int(a), int(b)) for a, b in views[views[:, 0] > 0].tolist()],
            )  # fmt: skip
        meta, tables = got[:, :META_WIDTH], got[:, META_WIDTH:]
        most = int(meta[:, ROWS].max())
        if most > k:  # the rows beyond the hint, in a second gather
            rest = torch.zeros((most - k) * w, dtype=torch.int64)
            tail = table[k:].reshape(-1)
            rest[: tail.size] = torch.from_numpy(tail)
            more = self.ex.all_gather_start(rest, self.round).wait().numpy()
            tables = np.concatenate([tables, more], axis=1)
        self.rows_hint = max(16, 1 << max(most - 1, 0).bit_length())
        groups, updates = S.gather_tables(tables, meta[:, ROWS])
        return meta, groups, updates

    def _check(self, meta: np.ndarray) -> Request:
        """The learners' common request (they must agree; producers ask for nothing)."""
        closing = meta[:, CLOSING] > 0
        ref = next((r for r in self.learners if not closing[r]), self.learners[0])
        first = meta[ref]
        for r in range(meta.shape[0]):
            if closing[r]:  # a closing rank asks for nothing; the others learn of it below
                continue
            asked = meta[r, [WANT, BUDGET, MIN_PIECE]]
            expect = first[[WANT, BUDGET, MIN_PIECE]] if r in self.learners else np.zeros(3)
            if not np.array_equal(asked, expect):
                raise ConfigError(
                    f"token round {self.round}: rank {r} asked for (groups, token_budget, "
                    f"min_piece) = {tuple(asked.tolist())}, expected {tuple(expect.tolist())} "
                    "(every learner runs the same stream or fetch; producers call flush)"
                )
        return Request(int(first[WANT]), int(first[BUDGET]), int(first[MIN_PIECE]))

    # ------------------------------------------------------------------ the round

    def run(
        self, req: Request, weights, version: int, snap=None, ahead: bool = False
    ) -> tuple[list[MicroBatch], TokenRoundStats]:
        """Run one round (collective). Returns this rank's micro-batches (learners) and stats.

        Args:
            req: this rank's request.
            weights: the plane's ``WeightsState`` (the first learner's newer buffer is sent).
            version: this rank's policy version (the first learner's is the newest).
            snap: the weights as published when the round was launched (``weights.snapshot()``;
                ``None``: now): what it sends, whatever the caller publishes meanwhile.
            ahead: the round was launched ahead of the learner's next version (it will be
                taken after the learners published one more, as pacing has them do once per
                global batch): on the first learner it makes every rank select and evict for
                that version, so nothing delivered is older than the bound when it is used.

        Raises:
            ConfigError: when the learners' requests differ or fewer groups than learners are
                asked for.
            StaleDataError: if a selected sequence is older than the bound (a bug: the
                selection skips them).
            RoundError: on a timeout or a failed peer.
        """
        t0 = time.perf_counter()
        # the earlier rounds' NCCL works: forgotten once done, or failed by name when late
        self.ex.arrive(self.round)
        snap = weights.snapshot() if snap is None else snap
        meta, groups, updates = self._gather(req, weights, version, snap, ahead)
        req = self._check(meta)
        stats = TokenRoundStats(self.round, newest=int(meta[self.learners[0], VERSION]))
        closing = np.flatnonzero(meta[:, CLOSING])
        stats.closing_rank = int(closing[0]) if len(closing) else -1
        src = self.learners[0]
        if meta[src, WBYTES]:  # producer-only ranks or an ingress exist and learners published
            self._weights(meta, weights, snap)
        # the version the delivered sequences will be used at (one more for a round ahead)
        using = stats.newest + int(meta[src, AHEAD])
        self._apply_updates(updates)
        old = S.stale(groups, using, self.max_age)
        self._evict(groups, old, stats)
        chosen = self._select(groups, req, old, using)
        out: list[MicroBatch] = []
        if len(chosen):
            if self.max_age is not None and groups.version[chosen].min() < using - self.max_age:
                raise StaleDataError(
                    f"token round {self.round}: a selected group is older "
                    f"than max_policy_age={self.max_age}"
                )
            chosen, plan = S.planned(
                groups, chosen, req.want, len(self.learners), req.budget, self.token_cap
            )
            out = self._deliver(groups, chosen, plan, stats)
            stats.groups = len(chosen)
            stats.oldest_delivered = int(groups.version[chosen].min())
            mine = groups.table[chosen[groups.rank[chosen] == self.ex.rank], S.GID].tolist()
            if self.on_delivered is not None:
                self.on_delivered(mine, self.replay is None)
            if self.replay is None:
                self.store.remove(mine)
        stats.ms = (time.perf_counter() - t0) * 1e3
        self.round += 1
        return out, stats

    def _weights(self, meta: np.ndarray, weights, snap) -> None:
        """Send the learners' newer version: each learner's part to every rank that loads
        whole weights (the learners publish the same versions, data parallel)."""
        rows = meta[list(self.learners)][:, [VERSION, WBYTES, WHEAD, WSHARD]]
        if (rows != rows[0]).any():
            got = {r: tuple(row.tolist()) for r, row in zip(self.learners, rows)}
            raise ConfigError(
                f"token round {self.round}: the learners' published weights differ: (version, "
                f"bytes, header digest, sharded header bytes) by learner rank {got}; expected "
                "the same on every learner (each calls publish_weights with the same model at "
                "the same point)"
            )
        version, nbytes, head, sharded = (int(x) for x in rows[0])
        receivers = np.flatnonzero(meta[:, WHOLE]).tolist()
        slots = meta[list(self.learners), WSLOT].tolist()
        weights.exchange(
            self.ex, self.learners, version, nbytes, self.round, snap, head, receivers, slots,
            sharded,
        )  # fmt: skip

    def queue_priorities(self, holder: list[int], key: list[int], p: list[float]) -> None:
        """Queue per-sequence priorities for the next round's table: one update per group (its
        members' mean), routed to the holder by ``(holder, key)``."""
        acc: dict[tuple[int, int], list[float]] = {}
        for h, g, v in zip(holder, key, p, strict=True):
            acc.setdefault((h, g), []).append(v)
        self.updates += [(h, g, sum(v) / len(v)) for (h, g), v in acc.items()]

    def _apply_updates(self, updates: np.ndarray) -> None:
        for gid, holder, bits in updates[:, [S.GID, S.TOKENS, S.PRIORITY]].tolist():
            grp = self.store.groups.get(gid) if holder == self.ex.rank else None
            if grp is not None:  # a group consumed or evicted meanwhile: dropped
                grp.priority = float(np.int64(bits).view(np.float64))

    def _evict(self, groups: S.Groups, old: np.ndarray, stats: TokenRoundStats) -> None:
        mine = old & (groups.rank == self.ex.rank)
        if mine.any():
            self.store.evict(groups.table[mine, S.GID].tolist())
            stats.stale_evicted = int(mine.sum())
            self.stale_evicted += stats.stale_evicted

    def _select(self, groups: S.Groups, req: Request, old: np.ndarray, newest: int):
        if req.want == 0:
            return np.zeros(0, dtype=np.int64)
        if req.want < len(self.learners):
            raise ConfigError(
                f"token round {self.round}: cannot give each of "
                f"{len(self.learners)} learners a group: the batch asks for "
                f"{req.want}; ask for at least {len(self.learners)} groups"
            )
        if self.replay is None:
            return S.consume(
                groups, req.want, len(self.learners), req.min_piece, newest, self.max_age, old
            )
        rng = np.random.default_rng([self.seed, self.round])
        alpha = self.alpha if self.replay == "prioritized" else None
        return S.replay(groups, req.want, rng, alpha, old)

    # ------------------------------------------------------------------ delivery

    def _deliver(self, groups: S.Groups, chosen: np.ndarray, plan, stats) -> list[MicroBatch]:
        world, me = self.ex.world, self.ex.rank
        dest = np.full(len(chosen), -1)
        for li, mbs in enumerate(plan):
            dest[[i for mb in mbs for i in mb]] = self.learners[li]
        holder = groups.rank[chosen]
        n = np.zeros((world, world), np.int64)
        t = np.zeros((world, world), np.int64)
        np.add.at(n, (holder, dest), groups.table[chosen, S.MEMBERS])
        np.add.at(t, (holder, dest), groups.tokens[chosen])
        nbytes = (
            np.vectorize(self.wire.nbytes)(n, t)
            if world > 1
            else np.array([[self.wire.nbytes(int(n[0, 0]), int(t[0, 0]))]])
        )
        # the sections leave from and land in the arenas' device; host sections that go by
        # shared memory are packed straight into this rank's half of it (not copied there)
        # (lengths_on_host: device sections, or the rehearsal's extra exchange before the move)
        send = None if self.lengths_on_host else self.transport.lend(nbytes)
        lent = send is not None
        if send is None:
            send = self._buffer("send", int(nbytes[me].sum()))
        gids = groups.table[chosen, S.GID]
        mine = [  # destination by destination (rank order), each in its micro-batch order
            int(gids[i])
            for d in range(world)
            if d in self.learners
            for mb in plan[self.learners.index(d)]
            for i in mb
            if holder[i] == me
        ]
        lens = np.zeros(0, dtype=np.int64)
        if mine:
            try:
                lens = D.pack(self.store, self.wire, send, mine, n[me], t[me], nbytes[me])
            except BaseException:
                if lent:  # the next exchange must not take a half-written lent half
                    self.transport.unlend()
                raise
        recv = self._buffer("recv", int(nbytes[:, me].sum()))
        # device sections: their lengths travel on the host first (the cut reads them there,
        # and nothing comes back from the device; one exchange at a time on the plane's group)
        got = None
        if self.lengths_on_host:
            got = self._lengths(lens, n) if world > 1 else lens  # one rank: its own, in order
        # host sections through shared memory land straight in the micro-batches' columns
        learner = me in self.learners
        mbs = plan[self.learners.index(me)] if learner else []
        landing = None
        if learner and not self.lengths_on_host and self.transport.lands(nbytes):
            landing = D.land(self.wire, groups, chosen, holder, mbs, world)
            self.transport.land(landing[1])
        # [bytes, 1] rows: every strategy moves rows of one width (here one byte)
        self.transport.move(recv.view(-1, 1), send.view(-1, 1), nbytes, self.round, "tokens")
        if self.on_enqueued is not None:  # a backward waiting for the NCCL enqueue goes on
            self.on_enqueued()
        stats.wire_bytes = int(nbytes[:, me].sum())
        stats.token_bytes = int(
            n[:, me].sum() * self.wire.seq_bytes + t[:, me].sum() * self.wire.token_bytes
        )
        if not learner:
            return []
        if landing is not None:
            return D.landed(self.wire, landing[0], landing[2], groups, chosen, holder, self.device)
        return D.cut(self.wire, recv, nbytes[:, me], groups, chosen, holder, mbs, self.device, got)

    def _lengths(self, lens: np.ndarray, n: np.ndarray) -> np.ndarray:
        """The all-to-all of the sections' sequence lengths (host int64, ``n[src, dst]`` of
        them from each holder to each learner); returns what this rank received, holder by
        holder."""
        me = self.ex.rank
        send = torch.from_numpy(np.ascontiguousarray(lens, dtype=np.int64)).view(-1, 1)
        recv = torch.empty((int(n[:, me].sum()), 1), dtype=torch.int64)
        self.ex.all_to_all(
            recv, send, n[:, me].tolist(), n[me].tolist(), self.round, "tokens(lengths)"
        )
        return recv.numpy()[:, 0]
