"""DataPlane: the public face over a plane's components (built by ``assembly.assemble``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import nn

from conduit_dist.checkpoint import restore as restore_mod
from conduit_dist.checkpoint import save as save_mod
from conduit_dist.checkpoint import state
from conduit_dist.checkpoint.writer import Checkpoint
from conduit_dist.collectives.model import BandwidthModel
from conduit_dist.errors import CheckpointError, ConfigError, StaleDataError
from conduit_dist.flow.ratelimit import RateLimiter
from conduit_dist.flow.versions import check_ages, check_max_age
from conduit_dist.placement import Placement
from conduit_dist.plane.build import assemble, release
from conduit_dist.plane.waiting import fetch_records, wait_to_insert
from conduit_dist.records.spec import VERSION, ExperienceSpec
from conduit_dist.sampling import Sampler
from conduit_dist.sched import FetchTiming, fetch_timing
from conduit_dist.tiers import Tiers


class DataPlane:
    """A sharded experience store whose ingestion and delivery are torch.distributed collectives.

    Every rank hosts one shard. A *round* (one per ``fetch`` or ``flush``, the same number on
    every rank) ingests staged items, draws each learner's batch from the global store and
    delivers it: one ``all_to_all_single`` with ``local`` placement and ``uniform`` sampling on
    CPU, else a meta exchange, then ingestion and delivery (docs/architecture.md).

    Args:
        spec: fields of one experience item.
        capacity_per_rank: items each rank's shard holds; the oldest are evicted first.
        seed: run seed; with the round number it fixes every sample drawn.
        sampler: a ``Sampler`` or a name from ``registry.SAMPLERS`` (``uniform``: i.i.d. over
            the global store; ``stratified``).
        placement: a ``Placement`` or a name from ``registry.PLACEMENTS`` (``round_robin``).
        storage: a :class:`~conduit_dist.tiers.Tiers` (default: one memory tier on ``device``).
        learner_ranks: ranks that fetch (``None``: all); the others are actors and ``flush``.
        device: where batches are delivered (``cpu`` or ``cuda``).
        schedule: ``overlap`` (the next round starts at the attached module's backward),
            ``sync`` (inside ``fetch``) or ``auto`` (each rank times both, keeps the faster).
        max_lag: ``1``: a batch may miss this rank's puts made after its round was launched;
            ``0``: never (then overlap only between ``fetch(..., more=True)`` minibatches).
        auto_trial: iterations timed per mode with ``schedule="auto"``.
        timeout_s: seconds any collective may take before it fails with ``RoundError``.
        strategy: ``auto`` (the bandwidth model picks) or a strategy name to force.
        bandwidth: ``declared``, ``calibrate`` (probe the links once, cached in
            ``bandwidth_cache``) or a ``BandwidthModel``; :attr:`bandwidth` says which is used.
        bandwidth_cache: directory of calibration caches (``None``: no cache).
        trace: record a per-rank timeline for :meth:`export_trace`.
        reduce_numel: elements of :meth:`fetch`'s ``reduce`` (0: none; one-exchange, sync).
        max_policy_age: no learner gets an item whose ``"_version"`` is older than the newest
            policy version its rank knows minus this (``None``: no bound): shards evict their
            stale oldest items at every round start (counted: ``store_stats()``), and a fetch
            that would still return one raises ``StaleDataError`` (see ``versions.py``; with
            actors and ``k >= 1`` an item may be ``k + 1`` behind, see :meth:`fetch`). Not
            with samplers that keep per-item state (prioritized, sequences).
        rate_limiter: a :class:`~conduit_dist.flow.ratelimit.RateLimiter` (``min_size``,
            samples-per-insert with an error buffer, over the global store); a held fetch or
            put runs further rounds until it may pass or the limiter's ``timeout_s``.

    Raises:
        ConfigError: on a bad argument, naming it (nothing is left behind: no group, no files).
    """

    def __init__(
        self,
        spec: ExperienceSpec,
        capacity_per_rank: int,
        seed: int = 0,
        *,
        sampler: str | Sampler = "uniform",
        placement: str | Placement = "round_robin",
        storage: Tiers | None = None,
        learner_ranks: Sequence[int] | None = None,
        device: str | torch.device = "cpu",
        schedule: str = "overlap",
        max_lag: int = 1,
        auto_trial: int = 50,
        timeout_s: float = 60.0,
        strategy: str = "auto",
        bandwidth: str | BandwidthModel = "declared",
        bandwidth_cache: str | None = "~/.cache/conduit_dist",
        trace: bool = False,
        reduce_numel: int = 0,
        max_policy_age: int | None = None,
        rate_limiter: RateLimiter | None = None,
    ) -> None:
        self._closed = False
        p = assemble(
            spec, capacity_per_rank, seed, sampler=sampler, placement=placement, storage=storage,
            learner_ranks=learner_ranks, device=device, schedule=schedule, max_lag=max_lag,
            auto_trial=auto_trial, timeout_s=timeout_s, strategy=strategy, bandwidth=bandwidth,
            bandwidth_cache=bandwidth_cache, trace=trace, reduce_numel=reduce_numel,
            max_policy_age=max_policy_age, rate_limiter=rate_limiter,
        )  # fmt: skip
        self.rate_limiter = rate_limiter
        self.max_policy_age = max_policy_age
        self.spec, self.capacity_per_rank, self.device = spec, capacity_per_rank, p.runner.device
        self.rank, self.world, self.learner_ranks = (
            p.exchange.rank,
            p.exchange.world,
            p.learner_ranks,
        )
        self.is_learner = self.rank in self.learner_ranks
        self._all_learn = len(self.learner_ranks) == self.world
        self.shard, self.sampler, self.placement = p.shard, p.sampler, p.placement
        self.topology, self.bandwidth, self.calibration_s = p.topology, p.bandwidth, p.calibration_s
        self.timeline, self._p = p.timeline, p
        self._stale_refused = 0  # rows of batches refused by check_ages (taken from the store)
        self._ckpt: Checkpoint | None = None  # the latest checkpoint (maybe still writing)
        self._restore_dropped = 0  # items a restore could not fit (see checkpoint/restore.py)

    def __len__(self) -> int:
        """Items stored over all shards as of the latest completed round."""
        return int(self._p.runner.published.sum())

    @property
    def sizes(self) -> np.ndarray:
        """``int64 [world]``: items on each shard as of the latest completed round (a copy)."""
        return self._p.runner.published.copy()

    round = property(lambda self: self._p.clock.round, doc="Rounds prepared so far.")
    closed = property(lambda self: self._closed, doc="Whether :meth:`close` has run.")
    stats = property(lambda self: self._p.clock.stats, doc="The latest finished round's stats.")

    def put(
        self, batch: Mapping[str, torch.Tensor], *, donate: bool = False, version: int | None = None
    ) -> None:
        """Validate a batch and stage it for the next round (beyond the global capacity, the
        oldest staged items are dropped, and counted as evictions).

        Args:
            batch: ``name -> tensor [B, *shape]`` matching the spec (any device).
            donate: hand the tensors over instead of copying them now (the round packs them);
                do not modify them until the next round has completed.
            version: the policy version that produced the items, returned with them as
                ``"_version"`` (default: the version ``pull_weights`` or ``publish_weights``
                last returned on this rank, 0 before either).

        Raises:
            SpecError: on a field, dtype, shape or batch size that does not match, or NaN/inf;
                nothing is staged or stored then.
            ConfigError: with ``max_lag=0``, when the next fetch's round is in flight already.
        """
        self._check_open()
        if self.rate_limiter is not None:
            self._wait_to_insert(self._p.stager.user_spec.validate(batch))
        self._p.stager.put(batch, donate, version)

    def staged(self, n: int, *, version: int | None = None):
        """``with plane.staged(n) as rows:`` writable, uninitialised views (``name -> [n, ...]``)
        into staging rows; see ``Stager.staged``. Leaving the block checks NaN/inf and stages
        the items, tagged with ``version`` as in :meth:`put`; an exception or a failed check
        stages nothing."""
        self._check_open()
        if self.rate_limiter is not None and isinstance(n, int) and n >= 1:
            self._wait_to_insert(n)
        return self._p.stager.staged(n, version)

    def fetch(
        self,
        batch_size: int,
        *,
        more: bool = False,
        reduce: torch.Tensor | None = None,
        max_policy_age: int | None = None,
        wait_s: float = 0.0,
    ) -> dict[str, torch.Tensor]:
        """This learner's batch, drawn by the sampler from the global store.

        Args:
            batch_size: items to return.
            more: another fetch follows before the next ``put`` (minibatches of one rollout).
            reduce: a CPU float32 ``[reduce_numel]`` tensor, replaced by its mean over learners.
            max_policy_age: a bound for this fetch (``None``: the plane's), checked on every
                row against the newest version this rank knew when the round was prepared
                (with actors and a bound >= 1: the one it knew a round earlier, what the
                actors' shards evict by); a stricter one than the plane's is not enforced at
                the shards.
            wait_s: while nothing can be delivered (``EmptyStoreError``), run further rounds for
                up to this many seconds (the other ranks keep calling ``flush`` or ``fetch``:
                e.g. a learner waiting for actors that are pulling its weights).

        Returns:
            ``name -> [batch_size, *shape]`` views of one pooled buffer (rows grouped by shard),
            with ``"_version"`` (int64: the producer's policy version) beside the fields.

        Raises:
            ConfigError: on an actor, a bad ``batch_size``, or one above its launched round's.
            RoundError: if the round failed or timed out on some rank (names the rank).
            EmptyStoreError: if nothing can be delivered (after ``wait_s``; the rounds
                themselves completed).
            StaleDataError: if a row is older than the bound (the batch is not returned).
        """
        self._check_open()
        bound = check_max_age("fetch max_policy_age", max_policy_age)
        if not isinstance(wait_s, int | float) or not wait_s >= 0 or wait_s == float("inf"):
            raise ConfigError(f"fetch wait_s: expected a finite number >= 0, got {wait_s!r}")
        if self.rate_limiter is not None and isinstance(batch_size, int):
            self.rate_limiter.check_size("sample", batch_size)
        bound = self.max_policy_age if bound is None else bound
        records = fetch_records(
            self._p.control, batch_size, more, reduce, wait_s, self.rate_limiter
        )
        if self.sampler.windowed:  # sequences, n-step: composed rows (a copy)
            out = self.sampler.unpack(records)
        else:
            out = self._p.runner.outputs.unpack(records)
            if self.sampler.trailer_bytes:  # e.g. prioritized replay's _index and _weight
                out = {**out, **self.sampler.entries(records)}
        if bound is not None:
            st = self.stats
            try:
                # with actors, a version learners publish reaches them (and the bound their
                # shards evict by) one round later: a window (bound >= 1) is checked against
                # what every rank knew; bound 0 (on-policy) stays strict
                ref = st.newest if self._all_learn or bound == 0 else st.newest_before
                check_ages(out[VERSION], ref, bound, self.rank, st.round)
            except StaleDataError:
                self._stale_refused += int(out[VERSION].numel())
                raise
        return out

    def update_priorities(self, index: torch.Tensor, priority: torch.Tensor) -> None:
        """Set the priorities of fetched items (``Prioritized`` sampler, learners).

        Each update travels to the shard that holds the item in a later round; an update whose
        item was overwritten meanwhile is dropped and counted (``store_stats()``).

        Args:
            index: the ``"_index"`` entries of fetched batches (int64 ``[k]``, any device).
            priority: new priorities (``[k]``, finite, ``>= 0``; e.g. ``|TD error|``).

        Raises:
            ConfigError: without a sampler that takes updates, on an actor, on shapes, dtypes
                or addresses that do not match, or on NaN/inf/negative priorities (nothing is
                queued then).
        """
        self._check_open()
        if not self.is_learner:
            raise ConfigError(
                f"update_priorities: rank {self.rank} is an actor; learners update what they "
                "fetched"
            )
        if not self.sampler.routes_updates:
            raise ConfigError(
                f"update_priorities: the {self.sampler.name!r} sampler takes no priority "
                "updates; build the plane with sampler=cd.Prioritized(alpha > 0)"
            )
        index, priority = _check_updates(index, priority)
        self.sampler.queue_updates(index, priority)

    def fetch_start(self, batch_size: int, *, reduce: torch.Tensor | None = None) -> None:
        """Start the next ``fetch(batch_size)``'s round; return with its exchange in flight
        (work until that fetch overlaps it on this thread; later puts go to the round after).

        Args:
            batch_size: what that fetch will ask for (a larger one raises there).
            reduce: as in :meth:`fetch`, averaged when the round finishes (not at the fetch).

        Raises:
            ConfigError: on an actor, without one-exchange rounds, off ``sync``, or when a round
                is in flight already.
        """
        self._check_open()
        self._p.control.fetch_start(batch_size, reduce)

    def flush(self) -> None:
        """Take part in a round without fetching (actors, once per iteration after ``put``); in
        ``overlap`` mode it runs in the background. Raises ``RoundError`` if a round failed."""
        self._check_open()
        self._p.control.flush()

    def wait(self) -> None:
        """Block until no round runs (a round launched at backward stays for the next fetch).
        Raises ``RoundError`` if that round failed."""
        self._check_open()
        self._p.control.wait()

    def attach(self, module: nn.Module) -> None:
        """Launch the next fetch's round when ``module``'s backward starts (``overlap``/``auto``);
        ``ConfigError`` if a module is attached already."""
        self._p.control.attach(module)

    def detach(self) -> None:
        """Remove the backward hooks (a launched round still completes at the next call)."""
        self._p.control.detach()

    @property
    def chosen_schedule(self) -> str:
        """The schedule in force on this rank (``auto (trial)`` while ``auto`` is timing)."""
        return self._p.control.chosen_schedule

    def publish_weights(self, module: nn.Module) -> int:
        """Stage ``module``'s state for broadcast in the next round (first learner only; a no-op
        elsewhere). Returns the version the weights will carry: on the first learner one more
        than its last; on the other learners the number of their calls (learners publish in
        step, as under DDP, so it is the version of the weights they hold). Items this rank
        puts afterwards carry that version.

        Raises:
            ConfigError: on an actor (actors pull).
        """
        self._check_open()
        if not self.is_learner:
            raise ConfigError(
                f"publish_weights: rank {self.rank} is an actor; learners "
                f"{list(self.learner_ranks)} publish, actors pull_weights"
            )
        stager = self._p.stager
        stager.publishes += 1
        if self.rank == self.learner_ranks[0]:
            self._p.weights.publish(_unwrap(module))
            stager.version = self._p.weights.version
        else:
            stager.version = stager.publishes
        return stager.version

    def pull_weights(self, module: nn.Module) -> int:
        """Load the latest weights received into ``module``; returns their version (0: none yet),
        which items this rank puts afterwards carry. ``SpecError`` if its names, shapes or
        dtypes differ from the published ones."""
        self._check_open()
        version = self._p.weights.pull(_unwrap(module))
        if version:
            self._p.stager.version = version
        return version

    @property
    def policy_version(self) -> int:
        """The newest policy version this rank knows: the latest it published (learners) or
        received from the first learner's broadcasts."""
        return max(self._p.stager.version, self._p.weights.version)

    def store_stats(self) -> dict[str, object]:
        """This rank's shard: items and bytes per tier, demotions, evictions (with the items
        dropped at staging, also shown alone), without waiting for a running round."""
        out = {**self._p.store_stats(), **self.sampler.stats()}
        out["stale_evicted"] = self._p.runner.ages.evicted
        out["stale_refused"] = self._stale_refused
        out["restore_dropped"] = self._restore_dropped
        if self.rate_limiter is not None:
            lim = self.rate_limiter
            out.update(
                rate_inserted=lim.inserted, rate_sampled=lim.sampled,
                rate_blocked_sample_s=lim.blocked_s["sample"],
                rate_blocked_insert_s=lim.blocked_s["insert"],
            )  # fmt: skip
        return out

    def export_trace(self, path: str) -> str:
        """Write this rank's timeline as Chrome trace JSON (Perfetto); returns the path.
        ``ConfigError`` without ``trace=True``."""
        return self.timeline.export(path)

    @property
    def last_fetch(self) -> FetchTiming | None:
        """Exposed/hidden accounting of the latest fetch (``None`` before the first)."""
        last = self._p.control.last
        return None if last is None else fetch_timing(*last)

    def close(self) -> None:
        """Run the closing round, release the group, shard and worker (see ``assembly.release``).
        Collective; safe to call twice."""
        if not self._closed:
            failed = None
            try:
                if self._ckpt is not None:  # its thread reads the tiers: let it finish first
                    try:
                        self._ckpt.wait()
                    except CheckpointError as e:
                        failed = e  # raised once the plane is released
                release(self._p)
            finally:
                self._closed = not self._p.stager.in_block
            if failed is not None:
                raise failed

    def state_dict(self) -> dict[str, object]:
        """This rank's state (tensors and ints; see ``state.save``). Not collective: it waits for
        a running round, whose batch stays for its fetch; call it at the same point on every
        rank. ``RuntimeError`` if items were put since the last round."""
        self._check_open()
        self._p.control.quiesce()
        return state.save(self._p, self.spec)

    def load_state_dict(self, saved: dict[str, object]) -> None:
        """Restore :meth:`state_dict` (collective; see ``state.load``): ``ConfigError`` on another
        world size or spec, or ranks at different rounds."""
        self._check_open()
        if self._ckpt is not None:  # its thread reads the tiers this overwrites
            self._ckpt.wait()
        state.load(self._p, self.spec, saved)

    def checkpoint(
        self,
        root: str,
        *,
        extra: Mapping[str, object] | None = None,
        write_mbps: float = 0.0,
        checksum_mbps: float = 0.0,
        keep: int = 2,
        timeout_s: float = 600.0,
    ) -> Checkpoint:
        """Checkpoint the whole plane at this round boundary, written in the background
        (collective: call it at the same point on every rank; see ``checkpoint/``).

        Returns once every rank agreed on the round and fixed its items (a copy-on-write
        snapshot: rounds go on while a thread writes ``root/ckpt-ROUND``). A checkpoint still
        writing is waited for first. A failed write raises at the next call on the plane.

        Args:
            root: directory of checkpoints (one file system all ranks see).
            extra: this rank's own state to keep with it (tensors, numbers, strings, dicts;
                e.g. model and optimizer), returned by :meth:`restore`.
            write_mbps: the items' rate limit in MB/s (0: none, the default: as fast as the
                disk takes them, which keeps the writer ahead of the rounds' overwrites, so the
                rounds copy little).
            checksum_mbps: the rate limit in MB/s of the pass that then checksums the written
                items (0: none, the default: finishing fast cost the rounds least, measured).
            keep: complete checkpoints kept under ``root`` (older ones are removed).
            timeout_s: how long rank 0 waits for the other ranks' parts.

        Raises:
            CheckpointError: ranks at different rounds, items staged since the last round, or
                the previous checkpoint failed.
        """
        self._check_open()
        if not (isinstance(keep, int) and keep >= 1):
            raise ConfigError(f"checkpoint keep: expected an int >= 1, got {keep!r}")
        for name, mbps in (("write_mbps", write_mbps), ("checksum_mbps", checksum_mbps)):
            if not (isinstance(mbps, int | float) and mbps >= 0):
                raise ConfigError(f"checkpoint {name}: expected a number >= 0, got {mbps!r}")
        if self._ckpt is not None:
            self._ckpt.wait(timeout_s)
        self._p.control.quiesce()
        self._ckpt = save_mod.begin(
            self._p, self.spec, str(root), extra, rates=(write_mbps, checksum_mbps), keep=keep,
            timeout_s=timeout_s,
        )  # fmt: skip
        return self._ckpt

    def restore(self, path: str) -> dict[str, object] | None:
        """Restore a checkpoint: ``path`` itself, or the newest complete one under it (a torn
        or corrupted one is skipped), onto this plane, of the same or another world size and
        tier layout (collective; see ``checkpoint/restore.py``).

        Returns:
            The ``extra`` this rank saved (on a larger world: old rank 0's for new ranks).

        Raises:
            CheckpointError: when no complete checkpoint is there.
            ConfigError: on another spec, or items put since the last round.
        """
        self._check_open()
        if self._ckpt is not None:
            self._ckpt.wait()
        extra, self._restore_dropped = restore_mod.restore(self._p, self.spec, str(path))
        return extra

    def _wait_to_insert(self, n: int) -> None:
        p = self._p
        wait_to_insert(p.control, p.stager, self.rate_limiter, n, self.rank, self.__len__)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the DataPlane is closed")
        ck = self._ckpt
        if ck is not None and ck.error is not None and ck.done:
            self._ckpt = None  # raised once, here
            ck.wait()
        if self._p.stager.in_block:
            raise ConfigError("this call cannot run inside a staged() block: leave the block first")
        self._p.clock.check()


def _check_updates(index, priority) -> tuple[torch.Tensor, torch.Tensor]:
    """``update_priorities``' arguments as contiguous CPU int64 and float64 ``[k]`` tensors
    (their values are checked by the sampler).

    Raises:
        ConfigError: naming the argument, the expected and the received type or shape.
    """
    if not isinstance(index, torch.Tensor) or index.dtype != torch.int64 or index.dim() != 1:
        got = f"{index.dtype} {list(index.shape)}" if isinstance(index, torch.Tensor) else index
        raise ConfigError(f"update_priorities index: expected an int64 [k] tensor, got {got}")
    if not isinstance(priority, torch.Tensor) or not priority.dtype.is_floating_point:
        got = priority.dtype if isinstance(priority, torch.Tensor) else type(priority).__name__
        raise ConfigError(
            f"update_priorities priority: expected a floating-point tensor, got {got}"
        )
    if priority.shape != index.shape:
        raise ConfigError(
            f"update_priorities priority: expected shape {list(index.shape)} (one per index), "
            f"got {list(priority.shape)}"
        )
    index = index.detach().to("cpu", torch.int64).contiguous()
    priority = priority.detach().to("cpu", torch.float64).contiguous()
    return index, priority


def _unwrap(module: nn.Module) -> nn.Module:
    return module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module
