"""``TokenPlane``: token experience for LLM RL across torchrun ranks (docs/tokens.md).

Producers ``put`` ragged sequences of prompt groups into their own shard (no copy to another
rank until a learner takes them); learners ``stream`` (or ``fetch``) a global batch of whole
groups as token-balanced micro-batches, the same count on every learner; producers call
``flush`` to take part in the rounds, and ``reserve`` before generating to be paced by the
learners' policy version instead of having stale output dropped.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures

import torch
from torch import nn

from conduit_dist.collectives.dist import resolve_device
from conduit_dist.collectives.exchange import Exchange
from conduit_dist.collectives.topology import discover
from conduit_dist.collectives.transport import Transport
from conduit_dist.errors import ConfigError, EmptyStoreError, RoundError, SpecError
from conduit_dist.flow.versions import check_max_age
from conduit_dist.flow.weights import WeightsState
from conduit_dist.plane.build import bandwidth_model, rank_set
from conduit_dist.plane.options import TransportConfig
from conduit_dist.sched.hooks import BackwardTrigger
from conduit_dist.tokens.ahead import Ahead, TakeTiming
from conduit_dist.tokens.batch import MicroBatch
from conduit_dist.tokens.checkpoint import load_shares, save_shard
from conduit_dist.tokens.pacing import Pacer
from conduit_dist.tokens.round import Request, TokenRound, TokenRoundStats
from conduit_dist.tokens.spec import TokenSpec, check_batch
from conduit_dist.tokens.store import GroupStore

log = logging.getLogger("conduit_dist")
_ids = itertools.count()
REPLAYS = (None, "uniform", "prioritized")


class TokenPlane:
    """A sharded store of token sequences in prompt groups, delivered as balanced micro-batches.

    Args:
        spec: the fields (:class:`TokenSpec`: ragged per-token fields, fixed ones, the group
            field and ``group_size``).
        capacity_per_rank: sequences one shard holds.
        tokens_per_rank: tokens one shard holds (every ragged field alike); the oldest groups
            are evicted whole, and counted, when either capacity binds.
        learner_ranks: ranks that take micro-batches (default: all).
        producer_ranks: ranks that generate and ``reserve`` (default: all).
        max_policy_age: a delivered sequence's oldest token is at most this many versions
            behind the first learner's (``None``: no bound). With ``reserve`` nothing is ever
            dropped for age; without it, groups already too old are evicted and counted.
        groups_per_batch: the global batch, in groups (pacing: producers may run this many
            groups per version, ``max_policy_age + 1`` versions ahead).
        replay: ``None`` (each group delivered once: GRPO/PPO), ``"uniform"`` or
            ``"prioritized"`` (groups drawn again and again, by ``priority ** alpha``).
        alpha: prioritized replay's exponent.
        seed: the replay draw's seed.
        device: where micro-batches land (``"cuda"``: composed on the host, copied once).
        transport: collectives' timeout, strategy and bandwidth model (:class:`TransportConfig`).
        cost: what learners are balanced by, a sequence of ``L`` tokens costing ``"tokens"``
            (``L``, the default), ``"flops"`` (``a*L + b*L**2``, one transformer layer of width
            4096: ``tokens.cost.Flops``, whose ``Flops(a, b)`` or ``Flops.for_model(d)`` set
            other coefficients) or a callable ``L -> cost``; computed at put as integers.
        token_cap: the most tokens one micro-batch may hold, never exceeded (``None``: no cap,
            ``token_budget`` is a target); a put that would give a group more is refused
            (``SpecError`` naming it), and so is a ``token_budget`` above it (``ConfigError``
            in the round).

    Raises:
        ConfigError: on a bad argument, naming it, the expected and the received value.
        SpecError: on a capacity that cannot hold one group or one longest sequence.

    Example::

        spec = cd.TokenSpec({"tokens": cd.Ragged(torch.int32, 4096),
                             "reward": ((), torch.float32)}, group_size=8)
        with cd.TokenPlane(spec, 4096, 1 << 20, max_policy_age=1, groups_per_batch=32) as tp:
            ...
    """

    def __init__(
        self,
        spec: TokenSpec,
        capacity_per_rank: int,
        tokens_per_rank: int,
        *,
        learner_ranks: Sequence[int] | None = None,
        producer_ranks: Sequence[int] | None = None,
        max_policy_age: int | None = None,
        groups_per_batch: int | None = None,
        replay: str | None = None,
        alpha: float = 0.6,
        seed: int = 0,
        device: str | torch.device = "cpu",
        transport: TransportConfig | None = None,
        cost: str | Callable[[int], float] = "tokens",
        token_cap: int | None = None,
    ) -> None:
        if not isinstance(spec, TokenSpec):
            raise ConfigError(f"spec: expected a TokenSpec, got {type(spec).__name__}")
        if replay not in REPLAYS:
            raise ConfigError(f"replay: expected one of {list(REPLAYS)}, got {replay!r}")
        max_age = check_max_age("max_policy_age", max_policy_age)
        transport = TransportConfig.of(transport)
        self.spec, self.device = spec, resolve_device(device)
        self.store = GroupStore(spec, capacity_per_rank, tokens_per_rank, cost, token_cap)
        # host sections between the ranks of one host go through /dev/shm, as DataPlane's
        # (the same setting and default: transport.shared_memory, agreed at start-up)
        self.ex = Exchange(
            transport.timeout_s, name=f"tokens{next(_ids)}", device="cpu",
            shared_memory=transport.shared_memory,
        )  # fmt: skip
        try:
            self.learners = rank_set("learner_ranks", learner_ranks, self.ex.world)
            producers = rank_set("producer_ranks", producer_ranks, self.ex.world)
            topo = discover(self.ex)
            model, _ = bandwidth_model(
                transport.bandwidth, self.ex, topo, transport.bandwidth_cache
            )
            self.pacer = Pacer(max_age, groups_per_batch, producers, self.ex.rank)
        except BaseException:
            self.ex.close()
            raise
        self.rank, self.world = self.ex.rank, self.ex.world
        moves = Transport(self.ex, topo, model, transport.strategy)
        self.engine = TokenRound(
            self.store,
            self.ex,
            moves,
            self.learners,
            max_age,
            replay,
            float(alpha),
            int(seed),
            self.device,
            token_cap,
        )
        self.weights = WeightsState()
        self.version = 0  # this rank's: published (learners) or pulled (producers)
        self.newest = 0  # the first learner's, as of the last round
        self.closed, self.closed_by = False, -1
        self.last: TokenRoundStats | None = None
        self.totals = {"delivered_groups": 0, "wire_bytes": 0, "token_bytes": 0, "rounds": 0}
        self._sends_weights = any(r not in self.learners for r in range(self.world))
        # the next take's first round, launched at a backward or by fetch_start (ahead.py)
        self.ahead = Ahead(self.device, transport.timeout_s)
        self.last_take: TakeTiming | None = None
        self._priorities: list[tuple[list[int], list[int], list[float]]] = []  # for the round
        self.at_close = {"groups": 0, "sequences": 0, "launched_groups": 0}

    # ------------------------------------------------------------------ producers

    def put(
        self,
        batch: Mapping[str, torch.Tensor],
        lengths: torch.Tensor | None = None,
        *,
        version: int | None = None,
        token_versions: torch.Tensor | None = None,
    ) -> None:
        """Store sequences on this rank's shard (no collective); checked whole first.

        Args:
            batch: ragged fields packed ``[sum(L), *inner]`` (with ``lengths``) or as jagged
                nested tensors; fixed fields ``[B, *shape]``, the group field among them.
            lengths: ``[B]`` sequence lengths (omit with nested tensors).
            version: the policy version that generated them (default: this rank's).
            token_versions: ``[sum(L)]`` int64 per-token versions; a sequence counts as old
                as its oldest token.

        Raises:
            SpecError: naming the field, expected and received value; nothing is stored.
            ConfigError: after ``close``.
        """
        self._open("put")
        self._settle()  # the store is a launched round's until it ended
        v = self.version if version is None else int(version)
        try:
            packed = check_batch(self.spec, batch, lengths, v, token_versions)
        except SpecError:  # a reserved group that will never arrive must not hold a place
            gids = batch.get(self.spec.group) if isinstance(batch, Mapping) else None
            if isinstance(gids, torch.Tensor):
                self.store.cancel(gids.reshape(-1).tolist())
            raise
        self.store.add(packed)

    def reserve(self, group_ids: Sequence[int], model: nn.Module | None = None) -> int | None:
        """Ask before generating ``group_ids``: waits (running rounds, as ``flush``) while
        output generated now could exceed ``max_policy_age`` by the time it is consumed.

        Args:
            group_ids: the groups about to be generated (new on this rank).
            model: pulled to the newest weights first (producers that are not learners).

        Returns:
            The policy version to generate with (tag the sequences with it), or ``None`` once
            a learner has closed the plane.

        Raises:
            ConfigError: on a rank not in ``producer_ranks``; SpecError: on a reused group id.
        """
        self._open("reserve")
        self._settle()
        ids = [int(g) for g in group_ids]
        if self.closed_by >= 0:
            return None
        if model is None and self.pacer.on and self.rank not in self.learners:
            raise ConfigError(
                "reserve: expected model= on a producer-only rank (pacing counts "
                "the version of the weights it generates with, which pull_weights "
                "advances), got None"
            )
        while True:
            if model is not None and self.rank not in self.learners:
                self.pull_weights(model)
            if self.pacer.allows(len(ids), self.version):
                self.store.reserve(ids, self.version)
                self.pacer.started += len(ids)
                return self.version
            if not self.flush():
                return None

    def allowance(self) -> int | None:
        """Groups this producer may ``reserve`` now without waiting (no collective).

        A colocated producer that calls ``reserve`` from a learner's ``stream(produce=...)``
        callback asks for at most this many, since waiting there would run a round inside
        another round.

        Returns:
            Its window at its current version minus the groups it already reserved (>= 0), or
            ``None`` when producers are not paced (no ``groups_per_batch``).

        Raises:
            ConfigError: on a rank not in ``producer_ranks``, or after ``close``.
        """
        self._open("allowance")
        if not self.pacer.producer:
            raise ConfigError(f"allowance: rank {self.rank} is not in producer_ranks")
        if not self.pacer.on:
            return None
        return max(0, self.pacer.window(self.version) - self.pacer.started)

    @property
    def share(self) -> int:
        """Groups this producer may start per version when paced (its share of
        ``groups_per_batch``; 0 when not paced or not a producer): a ``reserve`` of at most
        this many is always granted within one more version."""
        return self.pacer.quota

    def flush(self) -> bool:
        """Take part in one round without asking for groups (producers, idle learners).

        Returns:
            ``False`` once a rank has closed the plane (then stop and ``close``).
        """
        if self.closed_by >= 0:
            return False
        if self.ahead.pending is not None:
            raise ConfigError(
                "flush: a round was launched for the next fetch/stream (at a backward or by "
                "fetch_start) and holds its micro-batches; call fetch/stream to take them"
            )
        self._round(Request())
        return self.closed_by < 0

    # ------------------------------------------------------------------ learners

    def stream(
        self,
        num_groups: int,
        token_budget: int,
        *,
        produce: Callable[[], None] | None = None,
        wait_s: float = 600.0,
    ) -> Iterator[MicroBatch]:
        """A global batch of ``num_groups`` whole groups, as micro-batches as soon as enough
        complete groups exist (every learner calls it alike; collective).

        Args:
            num_groups: groups in the global batch (at least one per learner).
            token_budget: tokens per micro-batch; each learner gets the same number of
                micro-batches, none empty, balanced by tokens (a group is never split).
            produce: called before each round on this rank (colocated generation).
            wait_s: give up when the batch is not complete after this long.

        Yields:
            :class:`MicroBatch` es; ``mb.index == (i, count)`` within each delivered piece.

        Raises:
            ConfigError: on a non-learner rank, fewer groups than learners or a budget < 1.
            EmptyStoreError: when ``wait_s`` passes first.
        """
        yield from self._take(num_groups, token_budget, produce, wait_s, streaming=True)

    def fetch(
        self,
        num_groups: int,
        token_budget: int,
        *,
        produce: Callable[[], None] | None = None,
        wait_s: float = 600.0,
    ) -> list[MicroBatch]:
        """The whole global batch at once: rounds run until ``num_groups`` complete groups
        exist, then one piece is delivered (arguments and errors as :meth:`stream`)."""
        return list(self._take(num_groups, token_budget, produce, wait_s, streaming=False))

    def _take(self, n: int, budget: int, produce, wait_s: float, streaming: bool):
        self._open("stream")
        self._check_take(n, budget)
        key = (n, budget, streaming)
        pending = self.ahead.pending
        if pending is not None and pending.key != key:
            raise ConfigError(
                f"stream/fetch: a round was launched ahead for (num_groups, token_budget, "
                f"stream) = {pending.key}, got {key}; keep them fixed between steps"
            )
        self.ahead.armed = None
        timing = self.last_take = TakeTiming()
        start, left = time.monotonic(), n
        launched = self.ahead.take(key, time.perf_counter(), timing)
        if launched is not None:
            out, stats = self._account(*launched)
            left -= stats.groups
            if not left:  # the batch is complete: the next backward launches the next one
                self.ahead.armed = key
            yield from out
        while left:
            if time.monotonic() - start > wait_s:
                raise EmptyStoreError(
                    f"stream: {n - left} of {n} groups delivered after "
                    f"{wait_s:.0f} s (wait_s); are the producers putting "
                    "whole groups and calling flush()?"
                )
            if self.closed_by >= 0:
                raise RoundError(
                    f"stream: rank {self.closed_by} closed the plane with "
                    f"{left} of {n} groups undelivered"
                )
            if produce is not None:
                produce()
            piece = len(self.learners) if streaming else left
            t0 = time.perf_counter()
            out, stats = self._round(Request(left, budget, piece))
            timing.rounds += 1
            timing.exposed_ms += (time.perf_counter() - t0) * 1e3
            left -= stats.groups
            if not left:  # the batch is complete: the next backward launches the next one
                self.ahead.armed = key
            yield from out
            if left and self.closed_by >= 0:
                raise RoundError(
                    f"stream: rank {self.closed_by} closed the plane with "
                    f"{left} of {n} groups undelivered"
                )

    def fetch_start(
        self, num_groups: int, token_budget: int, *, stream: bool = False,
        next_version: bool = True,
    ) -> None:  # fmt: skip
        """Launch the next ``fetch`` (``stream=True``: ``stream``) call's first round now, on
        the plane's round thread, and return (every learner calls it at the same point, e.g.
        when its backward starts; collective with the producers' rounds). That call then takes
        its micro-batches, waiting only for what is left of the round, and runs any further
        round inline (docs/tokens.md, "Behind the backward"; ``last_take`` says what was
        hidden). Puts and ``reserve`` wait for a round in flight (it holds the store).

        Args:
            num_groups: the next call's ``num_groups``.
            token_budget: the next call's ``token_budget``.
            stream: the next call is ``stream`` (a piece as soon as each learner can get a
                group) rather than ``fetch`` (the whole batch at once).
            next_version: the learners publish one more version before that call takes it (one
                per global batch, as pacing assumes): the round selects for that version, so
                nothing it delivers is older than ``max_policy_age`` when used. ``False``:
                for the version they have now.

        Raises:
            ConfigError: on a non-learner rank, a bad argument, or a round launched already.
        """
        self._open("fetch_start")
        self._check_take(num_groups, token_budget)
        if self.ahead.pending is not None:
            raise ConfigError("fetch_start: a round was launched already; take it first")
        self._launch((num_groups, token_budget, bool(stream)), next_version)

    def attach(self, module: nn.Module) -> None:
        """Launch each global batch's first round when ``module``'s backward starts: the first
        backward after a ``fetch``/``stream`` completed launches the next one with the same
        arguments (every learner runs the same number of micro-batches, so every learner
        launches at the same point), for the next version (:meth:`fetch_start`).

        Raises:
            ConfigError: on a non-learner rank, or a module attached already.
        """
        self._open("attach")
        if self.rank not in self.learners:
            raise ConfigError(f"attach: rank {self.rank} is not a learner; producers flush")
        if self.ahead.trigger is not None:
            raise ConfigError("attach: a module is attached already; call detach() first")
        self.ahead.trigger = BackwardTrigger(module, self._on_backward, lambda a, b: None)

    def detach(self) -> None:
        """Remove the backward hooks (a round launched already is still taken next)."""
        if self.ahead.trigger is not None:
            self.ahead.trigger.remove()
            self.ahead.trigger = None

    def _on_backward(self) -> None:
        """At a backward start: launch the armed next take's first round, once."""
        key = self.ahead.armed
        if key is None or self.closed or self.closed_by >= 0 or self.ahead.pending is not None:
            return
        self._launch(key, next_version=True)

    def _launch(self, key, next_version: bool) -> None:
        n, budget, streaming = key
        req = Request(n, budget, len(self.learners) if streaming else n)
        self._hand_priorities()
        snap, version, weights = self.weights.snapshot(), self.version, self.weights
        self.ahead.launch(
            key, lambda: self.engine.run(req, weights, version, snap, ahead=next_version)
        )

    def _settle(self) -> None:
        """Wait until a round launched ahead has ended (its result stays for its take)."""
        p = self.ahead.pending
        if p is not None:
            futures.wait([p.future], timeout=4 * self.ahead.timeout_s)

    def _check_take(self, n: int, budget: int) -> None:
        """A learner's take arguments.

        Raises:
            ConfigError: on a non-learner rank, a bad count or budget, or a count pacing does
                not expect.
        """
        if self.rank not in self.learners:
            raise ConfigError(
                f"stream/fetch: rank {self.rank} is not a learner (learner_ranks="
                f"{list(self.learners)}); producers call flush()"
            )
        for name, v in (("num_groups", n), ("token_budget", budget)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name}: expected an int >= 1, got {v!r}")
        if self.pacer.on and n != self.pacer.per_batch:
            raise ConfigError(
                f"num_groups: pacing by version assumes one global batch of "
                f"groups_per_batch = {self.pacer.per_batch} groups per version, "
                f"got {n}"
            )
        cap = self.store.token_cap
        if cap is not None and budget > cap:  # refused here, before any round runs
            raise ConfigError(
                f"token_budget: expected at most token_cap = {cap} (the most tokens a "
                f"micro-batch may hold), got {budget}"
            )

    def update_priorities(self, batch: MicroBatch, priority: torch.Tensor) -> None:
        """Set the replay priority of each group in ``batch`` (one value per sequence: a group
        takes its members' mean); applied by the holders in the next round."""
        gid = batch["_key"].tolist()
        holder = batch["_holder"].tolist()
        pr = priority.detach().to("cpu", torch.float64).reshape(-1)
        if pr.shape[0] != batch.sequences or not bool(torch.isfinite(pr).all() & (pr >= 0).all()):
            raise SpecError(
                f"update_priorities: expected {batch.sequences} finite priorities >= 0 "
                f"(one per sequence), got {pr.shape[0]} with min "
                f"{float(pr.min()) if pr.numel() else 'n/a'}"
            )
        self._priorities.append((holder, gid, pr.tolist()))  # given to the next round

    # ------------------------------------------------------------------ versions and weights

    def publish_weights(self, model: nn.Module | None = None) -> int:
        """Advance the policy version (the first learner); with producer-only ranks, pack
        ``model``'s weights for the next round's broadcast. Other learners return their count.

        Raises:
            ConfigError: when producer-only ranks exist and no ``model`` is given.
        """
        self._open("publish_weights")
        if self.rank == self.learners[0] and self._sends_weights:
            if model is None:
                raise ConfigError(
                    "publish_weights: expected the model (producer-only ranks "
                    "pull its weights), got None"
                )
            self.weights.publish(model)
            self.version = self.weights.version
        else:
            self.version += 1
        return self.version

    def pull_weights(self, model: nn.Module) -> int:
        """Load the newest weights received into ``model`` (producer-only ranks); returns their
        version (unchanged when nothing newer arrived)."""
        v = self.weights.pull(model)
        self.version = max(self.version, v)
        return self.version

    # ------------------------------------------------------------------ rounds, state

    def _round(self, req: Request) -> tuple[list[MicroBatch], TokenRoundStats]:
        if self.closed_by >= 0:
            raise RoundError(f"token plane: rank {self.closed_by} closed it; no further round")
        self._hand_priorities()
        return self._account(*self.engine.run(req, self.weights, self.version))

    def _hand_priorities(self) -> None:
        """The priorities given since the last round, to the engine (on the caller's thread,
        while no round runs: the round reads them on whichever thread runs it)."""
        for holder, gid, pr in self._priorities:
            self.engine.queue_priorities(holder, gid, pr)
        self._priorities = []

    def _account(self, out, stats: TokenRoundStats) -> tuple[list[MicroBatch], TokenRoundStats]:
        """A finished round's effects on this rank's counters (on the caller's thread)."""
        self.newest, self.last = stats.newest, stats
        if stats.closing_rank >= 0:
            self.closed_by = stats.closing_rank
        t = self.totals
        t["delivered_groups"] += stats.groups
        t["wire_bytes"] += stats.wire_bytes
        t["token_bytes"] += stats.token_bytes
        t["rounds"] += 1
        return out, stats

    def stats(self) -> dict[str, int]:
        """This shard's counters: groups, sequences and tokens stored, evictions (capacity and
        age), and what this rank received."""
        s = self.store
        return {
            "groups": len(s.groups),
            "sequences": s.sequences,
            "tokens": s.live_tokens,
            "evicted_groups": s.evicted_groups,
            "evicted_sequences": s.evicted_sequences,
            "stale_evicted": self.engine.stale_evicted,
            **self.totals,
            **{f"left_at_close_{k}": v for k, v in self.at_close.items() if k != "launched_groups"},
            "launched_at_close_groups": self.at_close["launched_groups"],
        }

    def state_dict(self) -> dict[str, object]:
        """This rank's groups and counters (plain tensors; ``weights_only`` loads them).

        Raises:
            ConfigError: while a round launched ahead holds groups no take used yet.
        """
        if self.ahead.pending is not None:
            raise ConfigError(
                "state_dict: a round was launched ahead and holds the next take's groups; "
                "take it (fetch/stream) first"
            )
        return {
            "store": self.store.state_dict(),
            "spec": repr(self.spec.state_dict()),
            "round": self.engine.round,
            "version": self.version,
            "newest": self.newest,
            "started": self.pacer.started,
            "world": self.world,
        }

    def checkpoint(self, root: str) -> None:
        """Write every rank's buffered, not yet consumed groups under ``root`` (collective).

        Raises:
            ConfigError: while a round launched ahead holds micro-batches no take used yet.
        """
        self._open("checkpoint")
        if self.ahead.pending is not None:
            raise ConfigError(
                "checkpoint: a round was launched ahead and holds the next take's groups; "
                "checkpoint after that fetch/stream (or before the backward that launches it)"
            )
        save_shard(
            root,
            self.rank,
            self.world,
            self.state_dict(),
            self.ex,
            self.spec.group,
            self.spec.group_size,
        )

    def restore(self, root: str) -> None:
        """Load the groups a checkpoint under ``root`` holds, dealt whole over this job's ranks
        (any world size), and the counters (collective)."""
        self._open("restore")
        load_shares(root, self.rank, self.world, self, self.ex)

    def _open(self, what: str) -> None:
        if self.closed:
            raise ConfigError(f"{what}: the token plane is closed")

    def close(self) -> None:
        """Run the closing round (unless a peer's already ran) and release the group.

        Groups not delivered by then are counted, not delivered (``stats()``'s
        ``left_at_close_groups``/``_sequences``: those still in this rank's store, complete
        or still generating; ``launched_at_close_groups``: a round launched ahead that no take
        used, its groups taken out of their holders).
        """
        if self.closed:
            return
        self.closed = True
        try:
            if self.ahead.pending is not None:  # launched ahead, never taken
                _, stats = self._account(*self.ahead.wait()[:2])
                self.at_close["launched_groups"] += stats.groups
            if self.closed_by < 0:
                self._round(Request(closing=True))
        finally:
            self.at_close["groups"] += len(self.store.groups)
            self.at_close["sequences"] += self.store.sequences
            self.ahead.close()
            with contextlib.suppress(Exception):
                self.ex.close()

    def __enter__(self) -> TokenPlane:
        return self

    def abort(self) -> None:
        """Release the plane's group without a closing round (after a failure: the peers'
        next round then fails naming this rank instead of waiting for it)."""
        self.closed = True
        if self.ahead.trigger is not None:
            self.ahead.trigger.remove()
            self.ahead.trigger = None
        with contextlib.suppress(Exception):
            self.ex.close()

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        else:  # an exception: the peers' next round fails with this rank named, not hangs
            self.abort()
