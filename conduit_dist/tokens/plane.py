"""``TokenPlane``: token experience for LLM RL across torchrun ranks (docs/tokens.md).

Producers ``put`` ragged sequences of prompt groups into their own shard (no copy to another
rank until a learner takes them); learners ``stream`` (or ``fetch``) a global batch of whole
groups as token-balanced micro-batches, the same count on every learner; producers call
``flush`` to take part in the rounds, and ``reserve`` before generating to be paced by the
learners' policy version instead of having stale output dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from conduit_dist.attach.ingress import Ingress, open_for
from conduit_dist.attach.ledger import merge as merge_ledgers
from conduit_dist.collectives.dist import resolve_device
from conduit_dist.errors import ConfigError
from conduit_dist.flow.versions import check_max_age
from conduit_dist.plane.options import TransportConfig
from conduit_dist.tokens.attached import TokenTarget
from conduit_dist.tokens.batch import MicroBatch
from conduit_dist.tokens.build import build
from conduit_dist.tokens.checkpoint import load_shares, save_shard
from conduit_dist.tokens.closing import Closing
from conduit_dist.tokens.learner import TokenLearner
from conduit_dist.tokens.producer import TokenProducer
from conduit_dist.tokens.round import Request
from conduit_dist.tokens.spec import TokenSpec
from conduit_dist.tokens.versions import TokenVersions

log = logging.getLogger("conduit_dist")
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
        device: where the plane's arenas are and micro-batches land (``"cuda"``: the device
            path of docs/tokens.md, "Device": tokens put from GPU tensors stay on the GPU,
            sections move by NCCL, rounds run on the plane's round thread and side stream).
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
        self.spec, self.device = spec, resolve_device(device)
        p = build(
            spec, self.device, (capacity_per_rank, tokens_per_rank), learner_ranks,
            producer_ranks, max_age, groups_per_batch, (replay, alpha, seed),
            TransportConfig.of(transport), cost, token_cap,
        )  # fmt: skip
        self.store, self.ex, self.learners, self.pacer = p.store, p.ex, p.learners, p.pacer
        self.engine, self.weights, self.runner = p.engine, p.weights, p.runner
        self.rank, self.world = self.ex.rank, self.ex.world
        self.versions = TokenVersions(self.weights, self.rank, self.learners, self.world)
        self.closed = False
        self.ahead = self.runner.ahead  # the round launched ahead of the next take (ahead.py)
        self.producer = TokenProducer(
            spec, self.runner, self.store, self.pacer, self.versions, self.rank,
            self.rank in self.learners, self.flush,
        )  # fmt: skip
        self.learner = TokenLearner(
            self.runner, self.store, self.pacer, self.learners, self.rank,
            lambda: self.version, lambda: self.closed,
        )  # fmt: skip
        self.closing = Closing(self.runner, self.ex, self.store)
        self.ingress: Ingress | None = None  # open_ingress: producers outside the job
        self._ledgers: list[dict] | None = None  # a restored checkpoint's ledgers (every rank's)

    version = property(
        lambda s: s.versions.version,
        lambda s, v: setattr(s.versions, "version", v),
        doc="This rank's policy version: published (learners) or pulled (producers).",
    )
    newest = property(
        lambda s: s.runner.newest,
        lambda s, v: setattr(s.runner, "newest", v),
        doc="The first learner's version, as of the last round.",
    )
    closed_by = property(lambda s: s.runner.closed_by, doc="A rank that closed the plane (-1).")
    last = property(lambda s: s.runner.last, doc="The latest round's ``TokenRoundStats``.")
    totals = property(lambda s: s.runner.totals, doc="What this rank received, summed.")

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
        self.producer.put(batch, lengths, version, token_versions)

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
            ConfigError: on a rank not in ``producer_ranks``; while a round launched for the
                next take is pending and more than ``allowance()`` groups are asked (waiting
                would run rounds before that take's). SpecError: on a reused group id.
        """
        self._open("reserve")
        return self.producer.reserve(group_ids, model)

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
        return self.producer.allowance()

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
        self.runner.run(Request(), self.version)
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
        yield from self.learner.take(n, budget, produce, wait_s, streaming)

    def fetch_start(
        self, num_groups: int, token_budget: int, *, stream: bool = False,
        next_version: bool = True,
    ) -> None:  # fmt: skip
        """Launch the next ``fetch`` (``stream=True``: ``stream``) call's first round now, on
        the plane's round thread, and return (every learner calls it at the same point, e.g.
        when its backward starts; collective with the producers' rounds). That call then takes
        its micro-batches, waiting only for what is left of the round, and runs any further
        round inline (docs/tokens.md, "Behind the backward"; ``last_take`` says what was
        hidden). Puts and ``reserve`` wait for a round in flight (it holds the store); a
        ``reserve`` that would have to wait for a further round is refused until the take.

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
        self.learner.fetch_start(num_groups, token_budget, stream, next_version)

    def attach(self, module: nn.Module) -> None:
        """Launch each global batch's first round when ``module``'s backward starts: the first
        backward after a ``fetch``/``stream`` completed launches the next one with the same
        arguments (every learner runs the same number of micro-batches, so every learner
        launches at the same point), for the next version (:meth:`fetch_start`).

        Raises:
            ConfigError: on a non-learner rank, or a module attached already.
        """
        self._open("attach")
        self.learner.attach(module)

    def detach(self) -> None:
        """Remove the backward hooks (a round launched already is still taken next)."""
        self.learner.detach()

    last_take = property(
        lambda s: s.learner.last_take,
        doc="How the latest take went (``TakeTiming``: rounds, launched, exposed, hidden ms).",
    )

    def update_priorities(self, batch: MicroBatch, priority: torch.Tensor) -> None:
        """Set the replay priority of each group in ``batch`` (one value per sequence: a group
        takes its members' mean); applied by the holders in the next round.

        Raises:
            SpecError: unless one finite priority >= 0 per sequence (nothing is queued).
        """
        self.learner.update_priorities(batch, priority)

    # ------------------------------------------------------------------ versions and weights

    def publish_weights(self, model: nn.Module | None = None, *, send_now: bool = False) -> int:
        """Advance the policy version; with producer-only ranks or an open ingress, pack this
        learner's part of ``model``'s weights (learner ``i`` of ``L`` packs about ``1/L``),
        which the next round sends, bucket by bucket, to the ranks that load them. Every
        learner calls it at the same point (data parallel: the same weights).

        Args:
            model: the learner's module (``None``: only where no rank loads weights).
            send_now: run that round now, in this call (a round asking for no groups, as
                ``flush``; producers take part in theirs), packing each bucket just before
                it is sent, so the pack overlaps the transfer: for a learner that waits for
                its producers' new version anyway (synchronous RL). ``False``: pack now
                (a snapshot: the module may change at once) and send in the next round.

        Returns:
            The new version.

        Raises:
            ConfigError: when producer-only ranks or an ingress exist and no ``model`` is
                given; ``send_now`` while a round launched ahead holds the next take; in a
                round, when the learners' published versions differ.
            RoundError: ``send_now``, when the round fails or a rank closed the plane.
        """
        self._open("publish_weights")
        if send_now and self.ahead.pending is not None:
            raise ConfigError(
                "publish_weights(send_now=True): a round was launched for the next "
                "fetch/stream and holds its micro-batches; call fetch/stream first"
            )
        version = self.versions.publish(model, lazy=send_now)
        if send_now:
            try:
                self.runner.run(Request(), self.version, lazy=True)
            finally:
                self.weights.settle()  # packed even when the round sent nothing
        return version

    def pull_weights(self, model: nn.Module, in_place: bool = False) -> int:
        """Load the newest weights received whole into ``model`` (producer-only ranks);
        returns their version (unchanged when nothing newer arrived). A version is loaded
        only once every learner's part of it arrived.

        Args:
            model: the module to load.
            in_place: make ``model``'s tensors views of the received buffer instead of
                copying (no copy per load; see ``WeightsState.pull``).
        """
        return self.versions.pull(model, in_place)

    # ------------------------------------------------------------------ attached producers

    def open_ingress(
        self,
        run_dir: str | None = None,
        *,
        host: str = "0.0.0.0",
        port: int = 0,
        advertise: str | None = None,
        timeout_s: float | None = None,
        grace_s: float | None = None,
        window: int = 64,
        groups_per_version: int | None = None,
    ) -> str:
        """Let producers outside the job attach to this rank (``cd.attach``; docs/attach.md).

        Call it on every rank (each opens its own endpoint, written to
        ``run_dir/ingress-rank<r>.json``): from then on the first learner packs its weights at
        each ``publish_weights`` (give it the model) and every round broadcasts them, so any
        ingress serves them. Attached puts are stored on this rank's shard before each round.

        Args:
            run_dir: where the endpoint file goes (``None``: only the returned endpoint).
            host, port: where to listen (default: all interfaces, any free port).
            advertise: the address written in the endpoint (default: the interface that
                routes to ``MASTER_ADDR``).
            timeout_s: a producer silent this long is lost (default: the plane's timeout).
            grace_s: a lost producer not back after this long is dead, its incomplete groups
                dropped and counted (default: ``timeout_s``).
            window: puts a producer may have unacknowledged.
            groups_per_version: what an attached producer's ``reserve`` grants per learner
                version, up to ``max_policy_age + 1`` versions ahead (default: the plane's
                ``groups_per_batch``; ``None`` there too: not paced).

        Returns:
            The endpoint, ``host:port``.

        Raises:
            ConfigError: if one is open already, on a bad value, or the port cannot be bound.
        """
        self._open("open_ingress")
        per = self.pacer.per_batch or None if groups_per_version is None else groups_per_version
        if per is not None and (isinstance(per, bool) or not isinstance(per, int) or per < 1):
            raise ConfigError(f"open_ingress groups_per_version: expected an int >= 1, got {per!r}")
        self.ingress = open_for(
            self.ingress, TokenTarget(self, per), self.world, self.ex.timeout.total_seconds(),
            run_dir, timeout_s, host=host, port=port, advertise=advertise, grace_s=grace_s,
            window=window,
        )  # fmt: skip
        if self._ledgers is not None:  # restored from a checkpoint before it opened
            self.ingress.restore(self._ledgers)
        # attached producers pull whole weights from any ingress
        self.versions.sends = self.versions.serves = True
        self.engine.serves = True
        self.runner.drain = self.ingress.drain
        self.engine.on_delivered = self.ingress.delivered
        return self.ingress.endpoint

    def drain_ingress(self) -> int:
        """Store what attached producers sent since the last round now (rounds do it first
        anyway; for a rank that waits between rounds). Returns the puts stored (0: none open)."""
        self._open("drain_ingress")
        if self.ingress is None:
            return 0
        self.runner.settle()  # a round launched ahead has ended: the shard is this thread's
        return self.ingress.drain()

    def ledger(self) -> dict[str, dict[str, object]]:
        """This rank's experience ledger: per attached producer, puts received, acknowledged,
        sent again, refused, groups delivered and dropped by id, and its state
        (``attach/ledger.py``); empty without an ingress."""
        return {} if self.ingress is None else self.ingress.ledger()

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
            **self.closing.stats(),
            **(self.ingress.totals() if self.ingress is not None else {}),
        }

    def state_dict(self) -> dict[str, object]:
        """This rank's groups and counters (plain tensors; ``weights_only`` loads them).

        Raises:
            ConfigError: while a round launched ahead holds groups no take used yet.
        """
        self._idle("state_dict", "take it (fetch/stream) first")
        return {
            "store": self.store.state_dict(),
            "spec": repr(self.spec.state_dict()),
            "round": self.engine.round,
            "version": self.version,
            "newest": self.newest,
            "started": self.pacer.started,
            "world": self.world,
            "ledger": self._ledger_state(),
        }

    def _ledger_state(self) -> dict[str, dict[str, object]]:
        """The attached producers' ledger for a checkpoint: the open ingress's, else the one
        restored (carried to the next checkpoint), else empty."""
        if self.ingress is not None:
            return self.ingress.state_dict()
        if self._ledgers is not None:
            return {pid: a.as_dict() for pid, a in merge_ledgers(self._ledgers).items()}
        return {}

    def restore_ledger(self, states: list[dict]) -> None:
        """Take a checkpoint's ledgers (every old rank's; ``restore`` calls it): a producer
        that reattaches is told its last put stored as of the checkpoint, and what it had
        acknowledged since is counted lost (docs/attach.md)."""
        self._ledgers = [dict(s) for s in states]
        if self.ingress is not None:
            self.ingress.restore(self._ledgers)

    def checkpoint(self, root: str) -> None:
        """Write every rank's buffered, not yet consumed groups under ``root`` (collective).

        Raises:
            ConfigError: while a round launched ahead holds micro-batches no take used yet.
        """
        self._open("checkpoint")
        self._idle(
            "checkpoint",
            "checkpoint after that fetch/stream (or before the backward that launches it)",
        )
        spec, state = self.spec, self.state_dict()
        save_shard(root, self.rank, self.world, state, self.ex, spec.group, spec.group_size)

    def restore(self, root: str) -> None:
        """Load the groups a checkpoint under ``root`` holds, dealt whole over this job's ranks
        (any world size), and the counters (collective). Priorities given since the last round
        are dropped (they name groups of the store being replaced).

        Raises:
            ConfigError: after ``close``, or while a round launched ahead holds groups no take
                used yet (they would be delivered beside their restored copies).
        """
        self._open("restore")
        self._idle("restore", "take it (fetch/stream) first, or restore before the backward")
        self.runner.priorities = []
        load_shares(root, self.rank, self.world, self, self.ex)

    def _open(self, what: str) -> None:
        if self.closed:
            raise ConfigError(f"{what}: the token plane is closed")

    def _idle(self, what: str, hint: str) -> None:
        """Refuse ``what`` while a round launched ahead holds the next take's groups."""
        if self.ahead.pending is not None:
            raise ConfigError(
                f"{what}: a round was launched ahead and holds the next take's groups; {hint}"
            )

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
        if self.ingress is not None:  # attached producers are told, and stop
            self.ingress.close()
        self.closing.close(self.version)

    def __enter__(self) -> TokenPlane:
        return self

    def abort(self) -> None:
        """Release the plane's group without a closing round (after a failure: the peers'
        next round then fails naming this rank instead of waiting for it)."""
        self.closed = True
        if self.ingress is not None:
            self.ingress.close()
        self.closing.abort()

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        else:  # an exception: the peers' next round fails with this rank named, not hangs
            self.abort()
