"""DataPlane: the public face over a plane's parts (built by ``plane.build.assemble``)."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from conduit_dist.attach.ingress import Ingress, open_for
from conduit_dist.checkpoint.plane import Checkpoints
from conduit_dist.errors import ConfigError
from conduit_dist.flow.ratelimit import RateLimiter
from conduit_dist.flow.versions import PolicyVersions
from conduit_dist.placement import Placement
from conduit_dist.plane.attached import RowTarget
from conduit_dist.plane.build import assemble, release
from conduit_dist.plane.consumer import Consumer
from conduit_dist.plane.options import TransportConfig
from conduit_dist.plane.waiting import wait_to_insert
from conduit_dist.records.spec import ExperienceSpec
from conduit_dist.sampling import Sampler
from conduit_dist.sched import FetchTiming, fetch_timing
from conduit_dist.tiers import Tiers


def _delegate(part: str, method, queue_later: bool = False, drain: bool = False):
    """A ``DataPlane`` method that checks the plane is open, then calls ``method`` on its part
    ``part`` (the part documents it: docstring and signature are ``method``'s), outside
    ``torch.inference_mode`` (a batch fetched in it would otherwise leave inference tensors in
    the pools that later batches are views of, which autograd refuses to save). ``queue_later``:
    priority updates given on a GPU are queued first (``Consumer.queue_later``); ``drain``:
    attached producers' puts are staged first (they join this call's round)."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        self._check_open()
        if drain:
            self._drain()
        if queue_later:  # collective calls: a refused update raises at the next fetch
            self._consumer.queue_later(collective=True)
        if torch.is_inference_mode_enabled():  # the plane's pooled buffers and their views
            with torch.inference_mode(False):  # outlive the call: made as normal tensors
                return method(getattr(self, part), *args, **kwargs)
        return method(getattr(self, part), *args, **kwargs)

    return call


class DataPlane:
    """A sharded experience store whose ingestion and delivery are torch.distributed collectives.

    Every rank hosts one shard. A *round* (one per ``fetch`` or ``flush``, the same number on
    every rank) ingests staged items, draws each learner's batch from the global store and
    delivers it (docs/architecture.md). Every sampler runs on every placement, exactly.

    Args:
        spec: fields of one experience item.
        capacity_per_rank: items each rank's shard holds; the oldest are evicted first.
        seed: run seed; with the round number it fixes every sample drawn.
        sampler: a ``Sampler`` or a name from ``registry.SAMPLERS``.
        placement: a ``Placement`` or a name from ``registry.PLACEMENTS``; ``None``:
            ``registry.default_placement``.
        storage: a :class:`~conduit_dist.tiers.Tiers` (default: one memory tier where rounds
            compose rows, ``rounds/devices.py``).
        learner_ranks: ranks that fetch (``None``: all); the others are actors and ``flush``.
        device: where batches are delivered (``cpu``, ``cuda``, ``cuda:<i>``; every sampler).
        schedule: ``overlap`` (the next round starts at the attached module's backward),
            ``sync`` (inside ``fetch``) or ``auto`` (each rank times both, keeps the faster).
        max_lag: ``1``: a batch may miss this rank's puts made after its round was launched;
            ``0``: never (docs/architecture.md).
        auto_trial: iterations timed per mode with ``schedule="auto"``.
        transport: a :class:`~conduit_dist.plane.options.TransportConfig` (collective timeout,
            strategy, bandwidth model and its cache; ``None``: its defaults).
        trace: record a per-rank timeline for :meth:`export_trace`.
        reduce_numel: elements of :meth:`fetch`'s host ``reduce`` tensor (0: none; ``sync``).
        max_policy_age: no learner gets an item older than the newest version its rank knows
            minus this (``None``: no bound; ``flow/versions.py``).
        rate_limiter: a :class:`~conduit_dist.flow.ratelimit.RateLimiter`.

    Raises:
        ConfigError: on a bad argument, naming it (nothing is left behind: no group, no files).
    """

    def __init__(
        self,
        spec: ExperienceSpec,
        capacity_per_rank: int,
        *,
        seed: int = 0,
        sampler: str | Sampler = "uniform",
        placement: str | Placement | None = None,
        storage: Tiers | None = None,
        learner_ranks: Sequence[int] | None = None,
        device: str | torch.device = "cpu",
        schedule: str = "overlap",
        max_lag: int = 1,
        auto_trial: int = 50,
        transport: TransportConfig | None = None,
        trace: bool = False,
        reduce_numel: int = 0,
        max_policy_age: int | None = None,
        rate_limiter: RateLimiter | None = None,
    ) -> None:
        self._closed = False
        p = assemble(
            spec, capacity_per_rank, seed, sampler=sampler, placement=placement, storage=storage,
            learner_ranks=learner_ranks, device=device, schedule=schedule, max_lag=max_lag,
            auto_trial=auto_trial, transport=TransportConfig.of(transport), trace=trace,
            reduce_numel=reduce_numel, max_policy_age=max_policy_age, rate_limiter=rate_limiter,
        )  # fmt: skip
        self._p, self.spec, self.capacity_per_rank = p, spec, capacity_per_rank
        self.rate_limiter, self.max_policy_age = rate_limiter, max_policy_age
        self.device, self.rank, self.world = p.engine.device, p.exchange.rank, p.exchange.world
        self.learner_ranks, self.timeline = p.learner_ranks, p.timeline
        self.is_learner, self._versions = self.rank in self.learner_ranks, p.versions
        self.shard, self.sampler, self.placement = p.storage, p.sampler, p.placement
        self.topology, self.bandwidth, self.calibration_s = p.topology, p.bandwidth, p.calibration_s
        self._consumer, self._ckpt = Consumer(p, max_policy_age), Checkpoints(p, spec)
        self.ingress: Ingress | None = None  # open_ingress: producers outside the job

    def __len__(self) -> int:
        """:attr:`stored` plus this rank's puts no round has taken yet (at most the capacity): a
        warm-up ``while len(plane) < n: plane.put(...)`` ends on every rank. Exact at world size
        1; ranks may differ: decide collective steps by :attr:`stored`."""
        return min(self.stored + self._p.stager.pending, self.capacity_per_rank * self.world)

    stored = property(
        lambda s: int(s._p.engine.state.published.sum()),
        doc="Items over all shards as of the latest completed round (the same on every rank).",
    )
    sizes = property(lambda s: s._p.engine.state.published.copy(), doc="Items on each shard.")
    round = property(lambda self: self._p.clock.round, doc="Rounds prepared so far.")
    closed = property(lambda self: self._closed, doc="Whether :meth:`close` has run.")
    stats = property(lambda self: self._p.clock.stats, doc="The latest finished round's stats.")
    schedule = property(lambda s: s._p.engine.schedule, doc="``local``, ``fused`` or ``general``.")
    device_plan = property(
        lambda s: s._p.engine.devices,
        doc="Where tiers, rows and collectives go (``rounds.devices.DevicePlan``).",
    )

    def put(
        self, batch: Mapping[str, torch.Tensor], *, donate: bool = False, version: int | None = None
    ) -> None:
        """Validate a batch and stage it for the next round (past the global capacity the oldest
        staged are dropped, counted as evictions).

        Args:
            batch: ``name -> tensor [B, *shape]`` matching the spec (any device).
            donate: hand the tensors over (packed by the round; leave them until it completed).
            version: the items' policy version, ``"_version"`` (default: the latest pulled).

        Raises:
            SpecError: on a field, dtype, shape or size that does not match, or NaN/inf.
            ConfigError: with ``max_lag=0``, when the next fetch's round is in flight already.
        """
        self._check_open()
        self._drain()
        if self.rate_limiter is not None:
            self._wait_to_insert(self._p.stager.user_spec.validate(batch))
        self._p.stager.put(batch, donate, version)
        self._p.control.poll()  # an early-started round still in flight: hidden so far

    def staged(self, n: int, *, version: int | None = None):
        """``with plane.staged(n) as rows:`` writable views (``name -> [n, ...]``) of staging
        rows (``Stager.staged``); leaving the block checks NaN/inf and stages the items, tagged
        with ``version`` as in :meth:`put`; an exception or a failed check stages nothing."""
        self._check_open()
        if self.rate_limiter is not None and isinstance(n, int) and n >= 1:
            self._wait_to_insert(n)
        return self._p.stager.staged(n, version)

    fetch = _delegate("_consumer", Consumer.fetch, drain=True)

    update_priorities = _delegate("_consumer", Consumer.update_priorities)

    def fetch_start(self, batch_size: int, *, reduce: torch.Tensor | None = None) -> None:
        """Start the next ``fetch(batch_size)``'s round and return with its exchange in flight
        (fused schedule, ``sync``; later puts go to the round after). ``ConfigError`` otherwise,
        on an actor, or when a round is in flight already."""
        self._check_open()
        self._drain()
        self._consumer.queue_later()
        self._p.control.fetch_start(batch_size, reduce)

    def flush(self) -> None:
        """Take part in a round without fetching (actors, once per iteration after ``put``); in
        ``overlap`` mode it runs in the background. ``RoundError`` if a round failed."""
        self._check_open()
        self._drain()
        self._consumer.queue_later()
        self._p.control.flush()

    def wait(self) -> None:
        """Block until no round runs (one launched at backward stays for the next fetch)."""
        self._check_open()
        self._p.control.wait()

    def attach(self, module: nn.Module) -> None:
        """Launch the next fetch's round when ``module``'s backward starts (``overlap``/``auto``);
        ``ConfigError`` if a module is attached already. Under a fixed ``sync`` schedule with no
        trace the module is attached without hooks (they would have nothing to do)."""
        self._p.control.attach(module)

    def detach(self) -> None:
        """Remove the backward hooks (a launched round still completes at the next call)."""
        self._p.control.detach()

    chosen_schedule = property(lambda s: s._p.control.chosen_schedule, doc="This rank's schedule.")

    publish_weights = _delegate("_versions", PolicyVersions.publish)
    pull_weights = _delegate("_versions", PolicyVersions.pull)
    policy_version = property(lambda s: s._versions.newest, doc="The newest version known.")

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
    ) -> str:
        """Let producers outside the job attach to this rank (``cd.attach(run_dir, "rows")``;
        docs/attach.md): their puts are staged here as this rank's own, before each of this
        rank's calls, and acknowledged once staged. Arguments, returns and errors as
        ``TokenPlane.open_ingress`` (each rank that calls it opens its own endpoint)."""
        self._check_open()
        self.ingress = open_for(
            self.ingress, RowTarget(self), self.world, self._p.exchange.timeout.total_seconds(),
            run_dir, timeout_s, host=host, port=port, advertise=advertise, grace_s=grace_s,
            window=window,
        )  # fmt: skip
        return self.ingress.endpoint

    def ledger(self) -> dict[str, dict[str, object]]:
        """This rank's experience ledger: per attached producer, puts received, acknowledged,
        sent again, refused, and its state (``attach/ledger.py``); empty without an ingress."""
        return {} if self.ingress is None else self.ingress.ledger()

    def store_stats(self) -> dict[str, object]:
        """This rank's shard: items and bytes per tier, demotions, evictions (with the items
        dropped at staging, also shown alone), the sampler's and flow control's counters;
        never waits for a running round."""
        c = self._consumer
        attached = self.ingress.totals() if self.ingress is not None else {}
        return self._p.store_stats(
            stale_refused=c.stale_refused, **self._ckpt.counters(), **attached
        )

    def export_trace(self, path: str) -> str:
        """Write this rank's timeline as Chrome trace JSON (``trace=True``); returns the path."""
        return self.timeline.export(path)

    @property
    def last_fetch(self) -> FetchTiming | None:
        """Exposed/hidden accounting of the latest fetch (``None`` before the first)."""
        last = self._p.control.last
        return None if last is None else fetch_timing(*last)

    def close(self) -> None:
        """Run the closing round, release the group, shard and worker (``build.release``).
        Collective; safe to call twice."""
        if self._closed:
            return
        if self.ingress is not None:  # attached producers are told, and stop
            self.ingress.close()
        failed = self._ckpt.close()  # its thread reads the tiers: let it finish first
        try:
            release(self._p)
        finally:
            self._closed = not self._p.stager.in_block
        if failed is not None:
            raise failed

    def __enter__(self) -> DataPlane:
        """``with cd.DataPlane(...) as plane:`` closes it when the block ends."""
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        """Close (collective); an exception leaving the block propagates, a failed close noted."""
        try:
            self.close()
        except Exception as failed:
            if exc is None:
                raise
            exc.add_note(f"closing the DataPlane also failed: {failed!r}")
        return False

    state_dict = _delegate("_ckpt", Checkpoints.state_dict, queue_later=True)
    load_state_dict = _delegate("_ckpt", Checkpoints.load_state_dict)
    checkpoint = _delegate("_ckpt", Checkpoints.checkpoint, queue_later=True)
    restore = _delegate("_ckpt", Checkpoints.restore)

    def _wait_to_insert(self, n: int) -> None:
        p = self._p
        wait_to_insert(p.control, p.stager, self.rate_limiter, n, self.rank, lambda: self.stored)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the DataPlane is closed")
        if self._ckpt.current is not None:
            self._ckpt.raise_failure()
        if self._p.stager.in_block:
            raise ConfigError("this call cannot run inside a staged() block: leave the block first")
        self._p.clock.check()

    def _drain(self) -> None:
        """Attached producers' puts, staged before this call's (put, flush, fetch)."""
        if self.ingress is not None:
            self.ingress.drain()
