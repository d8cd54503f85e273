"""DataPlane: the public put / fetch / flush / weights API over a sharded experience store."""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import nn

from conduit_dist.collectives.exchange import Exchange
from conduit_dist.errors import ConfigError, EmptyStoreError, RoundError, SpecError
from conduit_dist.sampling.uniform import UniformSampler, allocate
from conduit_dist.spec import ExperienceSpec
from conduit_dist.staging import DoubleBuffer, RecordBuffer
from conduit_dist.tiers import POLICIES, MemoryTier, Shard, plan_ingest
from conduit_dist.tiers.placement import remainder_dealt

_META = 4  # staged, request, weights version, weights bytes
_plane_ids = itertools.count()


@dataclass
class RoundStats:
    """What one round did and how long each phase took (milliseconds, this rank)."""

    round: int = -1
    ingest_ms: float = 0.0
    sample_ms: float = 0.0
    deliver_ms: float = 0.0
    weights_ms: float = 0.0
    items_in: int = 0
    items_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    stored: int = 0

    @property
    def total_ms(self) -> float:
        """Wall time of the whole round."""
        return self.ingest_ms + self.sample_ms + self.deliver_ms + self.weights_ms

    def as_dict(self) -> dict[str, float]:
        """Plain dict, with ``total_ms``."""
        return {**asdict(self), "total_ms": self.total_ms}


class DataPlane:
    """A sharded experience store whose ingestion and delivery are torch.distributed collectives.

    Every rank hosts one shard of ``capacity_per_rank`` items. ``put`` validates and stages a batch
    locally; a *round* (run by ``fetch`` on learners and ``flush`` on actors, once per iteration on
    every rank) moves staged items to their owner shards in one fused ``all_to_all_single``, draws
    each learner's batch uniformly from the global store, and delivers it in a second one.

    Args:
        spec: fields of one experience item.
        capacity_per_rank: items each rank's shard holds; the oldest are overwritten first.
        seed: run seed; with the round number it fixes every sample drawn.
        device: where the shard lives and batches are delivered (``cpu`` or ``cuda``).
        placement: ``round_robin`` (shards fill evenly) or ``local`` (items stay where put).
        learner_ranks: ranks that fetch; ``None`` means every rank (colocated). The other ranks
            are actors: they ``put`` and call :meth:`flush` once per iteration.
        timeout_s: seconds any collective of a round may take before it fails with
            :class:`RoundError`.

    Raises:
        ConfigError: on a bad capacity, placement, device or learner rank.

    Example:
        >>> cd.init_distributed()
        >>> plane = cd.DataPlane(spec, capacity_per_rank=100_000, seed=0)
        >>> plane.put(transitions)        # every iteration, on every rank
        >>> batch = plane.fetch(256)      # learners; actors call plane.flush() instead
    """

    def __init__(
        self,
        spec: ExperienceSpec,
        capacity_per_rank: int,
        seed: int = 0,
        *,
        device: str | torch.device = "cpu",
        placement: str = "round_robin",
        learner_ranks: Sequence[int] | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        if not isinstance(spec, ExperienceSpec):
            raise ConfigError(f"spec: expected an ExperienceSpec, got {type(spec).__name__}")
        if not isinstance(capacity_per_rank, int) or capacity_per_rank < 1:
            raise ConfigError(f"capacity_per_rank: expected an int >= 1, got {capacity_per_rank!r}")
        if placement not in POLICIES:
            raise ConfigError(f"placement: expected one of {POLICIES}, got {placement!r}")
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s: expected > 0 seconds, got {timeout_s}")
        self.spec = spec
        self.device = torch.device(device)
        self.seed = int(seed)
        self.placement = placement
        self.exchange = Exchange(timeout_s, name=str(next(_plane_ids)))
        self.rank, self.world = self.exchange.rank, self.exchange.world
        self.learner_ranks = self._check_learners(learner_ranks)
        self.is_learner = self.rank in self.learner_ranks
        self.shard = Shard(MemoryTier(capacity_per_rank, spec.record_bytes, self.device))
        self.capacity_per_rank = capacity_per_rank
        self.sizes = np.zeros(self.world, dtype=np.int64)  # every shard's size, on every rank
        self.ingested = 0  # items ingested over all ranks
        self._dealt = 0  # round-robin remainder items dealt so far (where the next one goes)
        self.round = 0
        self.stats = RoundStats()
        self._stage = DoubleBuffer(spec.record_bytes, self.device)
        self._send = RecordBuffer(spec.record_bytes, self.device)
        self._recv = RecordBuffer(spec.record_bytes, self.device)
        self._sampler = UniformSampler(self.seed, self.rank)
        self._alloc_gen = torch.Generator()
        self._weights = _WeightsState()
        self._direct = 0  # items put straight into storage slots, counted at the next round
        self._inflight = False  # a round is running asynchronously (set by the scheduler)
        self._failed: RoundError | None = None
        self._closed = False

    def _check_learners(self, learner_ranks: Sequence[int] | None) -> tuple[int, ...]:
        if learner_ranks is None:
            return tuple(range(self.world))
        ranks = tuple(sorted({int(r) for r in learner_ranks}))
        if not ranks or any(not 0 <= r < self.world for r in ranks):
            raise ConfigError(
                f"learner_ranks: expected a non-empty subset of 0..{self.world - 1}, "
                f"got {list(learner_ranks)}"
            )
        return ranks

    # ------------------------------------------------------------------ public API

    def __len__(self) -> int:
        """Items stored over all shards as of the latest round."""
        return int(self.sizes.sum())

    def put(self, batch: Mapping[str, torch.Tensor]) -> None:
        """Validate a batch and stage it for the next round.

        Args:
            batch: ``name -> tensor [B, *shape]`` matching the spec (any device).

        Raises:
            SpecError: on a missing or extra field, wrong dtype or shape, disagreeing batch sizes,
                an empty batch or non-finite floats; nothing is staged then.
        """
        self._check_open()
        n = self.spec.validate(batch)
        self.spec.check_finite(batch)
        rows = self._direct_rows(n)
        if rows is not None:
            self.spec.pack(batch, rows)
            self._direct += n
            return
        stage = self._stage.current
        self.spec.pack(batch, stage.reserve(n))
        stage.commit(n)

    def _direct_rows(self, n: int) -> torch.Tensor | None:
        """At world size 1, the storage slots the next ``n`` items take, if writing there is safe.

        Safe when no round is in flight (nothing samples meanwhile), nothing is staged yet this
        round (put order is kept) and the slots do not wrap. The slots count at the next round;
        until then they are invisible, as staged items are.
        """
        if self.world != 1 or self._inflight or self._stage.current.count:
            return None
        start = self.shard.write_pos + self._direct
        if start + n > self.capacity_per_rank:
            return None
        return self.shard.tier.region(start, start + n)

    def fetch(self, batch_size: int) -> dict[str, torch.Tensor]:
        """Run a round and return this learner's batch, sampled uniformly from the global store.

        Args:
            batch_size: items to return.

        Returns:
            ``name -> tensor [batch_size, *shape]`` on the plane's device. The tensors are views
            into one freshly allocated packed buffer owned by the caller (rows keep the record
            stride; call ``.contiguous()`` where a kernel needs dense rows).

        Raises:
            ConfigError: on an actor rank, or a non-positive ``batch_size``.
            RoundError: if the round failed or timed out on some rank.
            EmptyStoreError: if nothing is stored yet (the round itself completed).
        """
        if not self.is_learner:
            raise ConfigError(
                f"fetch: rank {self.rank} is an actor (learner_ranks={list(self.learner_ranks)}); "
                "actors call flush() once per iteration instead"
            )
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size: expected an int >= 1, got {batch_size!r}")
        records = self._run_round(batch_size)
        if records.shape[0] != batch_size:
            raise EmptyStoreError(
                f"fetch({batch_size}) on rank {self.rank} in round {self.round - 1}: the store is "
                f"empty (0 items over {self.world} shards); put experience before fetching"
            )
        return self.spec.unpack(records)

    def flush(self) -> None:
        """Take part in a round without fetching: move staged items to their shards.

        Actors call this once per iteration (after their ``put``), at the point where learners call
        :meth:`fetch`; every rank must run the same number of rounds.

        Raises:
            RoundError: if the round failed or timed out on some rank.
        """
        self._run_round(0)

    def publish_weights(self, module: nn.Module) -> int:
        """Stage ``module``'s state for broadcast to every rank in the next round.

        Only the first learner rank publishes; on other ranks this is a no-op returning the
        latest version seen.

        Args:
            module: the learner's module (plain or DDP-wrapped).

        Returns:
            The version number the weights will carry.
        """
        self._check_open()
        if self.rank == self.learner_ranks[0]:
            self._weights.publish(_unwrap(module))
        return self._weights.version

    def pull_weights(self, module: nn.Module) -> int:
        """Load the latest weights received from the learners into ``module``.

        Args:
            module: a module with the same parameters and buffers as the learner's.

        Returns:
            The version loaded (0 when nothing was published yet; ``module`` is left untouched).

        Raises:
            SpecError: if the module's state does not match the published layout.
        """
        self._check_open()
        return self._weights.pull(_unwrap(module))

    def close(self) -> None:
        """Release the plane's process group and buffers. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.exchange.close()
        self.shard.tier.close()

    def state_dict(self) -> dict[str, object]:
        """This rank's shard, the global sizes and the round counter (tensors and ints only).

        Raises:
            RuntimeError: if items were put since the last round (call ``flush()`` first).
        """
        if self._direct or self._stage.current.count:
            raise RuntimeError(
                "state_dict: items were put since the last round; call flush() (or fetch) first"
            )
        return {
            "round": self.round,
            "ingested": self.ingested,
            "dealt": self._dealt,
            "sizes": torch.from_numpy(self.sizes.copy()),
            "shard": self.shard.state_dict(),
            "sampler": self._sampler.state_dict(),
            "spec": self.spec.state_dict(),
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore a state saved by :meth:`state_dict` on the same world size and spec.

        Raises:
            ConfigError: on a different world size or spec.
        """
        if state["spec"] != self.spec.state_dict():
            raise ConfigError(
                f"spec: checkpoint has {state['spec']}, plane has {self.spec.state_dict()}"
            )
        sizes = state["sizes"].numpy()
        if sizes.shape[0] != self.world:
            raise ConfigError(
                f"world size: checkpoint has {sizes.shape[0]}, plane has {self.world}"
            )
        self.shard.load_state_dict(state["shard"])
        self._sampler.load_state_dict(state["sampler"])
        self.sizes = sizes.astype(np.int64).copy()
        self.round, self.ingested = int(state["round"]), int(state["ingested"])
        self._dealt = int(state["dealt"])

    # ------------------------------------------------------------------ rounds

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the DataPlane is closed")
        if self._failed is not None:
            raise RoundError(
                f"the DataPlane failed in round {self._failed.round} and cannot continue: "
                f"{self._failed}",
                self._failed.round,
                self._failed.ranks,
            )

    def _run_round(self, request: int) -> torch.Tensor:
        self._check_open()
        try:
            return self._round(request)
        except RoundError as exc:
            self._failed = exc
            raise

    def _round(self, request: int) -> torch.Tensor:
        r = self.round
        stats = RoundStats(round=r)
        t0 = time.perf_counter()
        staged = self._stage.take()
        if self.world == 1:
            out = self._local_round(staged, request, r, stats, t0)
        else:
            self.exchange.heartbeat(r)
            meta = self._exchange_meta(staged.count, request, r)
            self._ingest(staged, meta[:, 0], r, stats)
            t1 = time.perf_counter()
            stats.ingest_ms = (t1 - t0) * 1e3
            counts = allocate(meta[:, 1], self.sizes, self.seed, r, self._alloc_gen)
            out = self._deliver(counts, r, stats, t1)
            t3 = time.perf_counter()
            self._weights.exchange(self.exchange, meta, self.learner_ranks[0], r)
            stats.weights_ms = (time.perf_counter() - t3) * 1e3
        stats.stored = len(self)
        self.stats = stats
        self.round = r + 1
        return out

    def _local_round(
        self, staged: RecordBuffer, request: int, r: int, stats: RoundStats, t0: float
    ) -> torch.Tensor:
        """World size 1: the same semantics with no collectives."""
        n_in = staged.count + self._direct
        if self._direct:
            self.shard.commit(self._direct)
            self._direct = 0
        if n_in:
            self.shard.append(staged.view())
            self.sizes[0] = self.shard.size
            self.ingested += n_in
        t1 = time.perf_counter()
        stats.ingest_ms = (t1 - t0) * 1e3
        size = self.shard.size
        n_out = request if size else 0
        out = torch.empty((n_out, self.spec.record_bytes), dtype=torch.uint8, device=self.device)
        if n_out:
            self.shard.gather(self._sampler.slots(n_out, size, r), out)
        stats.sample_ms = (time.perf_counter() - t1) * 1e3
        stats.items_in, stats.items_out = n_in, n_out
        stats.bytes_in, stats.bytes_out = n_in * out.shape[1], n_out * out.shape[1]
        return out

    def _exchange_meta(self, staged: int, request: int, r: int) -> np.ndarray:
        local = torch.tensor(
            [staged, request, self._weights.version, self._weights.nbytes], dtype=torch.int64
        )
        return self.exchange.all_gather(local, r).numpy()

    def _ingest(self, staged: RecordBuffer, counts: np.ndarray, r: int, stats: RoundStats) -> None:
        """Move staged items to their owner shards in one fused all-to-all."""
        plan = plan_ingest(self.placement, counts, self._dealt)
        inflow = plan.sum(axis=0)
        n_in = int(inflow[self.rank])
        if plan.any():
            direct = self.shard.receive_region(n_in)
            out = direct if direct is not None else self._recv.rows(n_in)
            self.exchange.all_to_all(
                out,
                staged.view(),
                plan[:, self.rank].tolist(),
                plan[self.rank].tolist(),
                r,
                "all_to_all(ingest)",
            )
            if direct is not None:
                self.shard.commit(n_in)
            else:
                self.shard.append(out)
        self.sizes = np.minimum(self.sizes + inflow, self.capacity_per_rank)
        self.ingested += int(counts.sum())
        self._dealt += remainder_dealt(counts)
        stats.items_in = n_in
        stats.bytes_in = n_in * self.spec.record_bytes

    def _deliver(self, counts: np.ndarray, r: int, stats: RoundStats, t1: float) -> torch.Tensor:
        """Sample this shard's share of every learner's batch and deliver in one all-to-all."""
        to_learners = counts[:, self.rank]
        n_send, n_recv = int(to_learners.sum()), int(counts[self.rank].sum())
        out = torch.empty((n_recv, self.spec.record_bytes), dtype=torch.uint8, device=self.device)
        send = self._send.rows(n_send)
        if n_send:
            self.shard.gather(self._sampler.slots(n_send, int(self.shard.size), r), send)
        t2 = time.perf_counter()
        stats.sample_ms = (t2 - t1) * 1e3
        if counts.any():
            self.exchange.all_to_all(
                out,
                send,
                counts[self.rank].tolist(),
                to_learners.tolist(),
                r,
                "all_to_all(deliver)",
            )
        stats.deliver_ms = (time.perf_counter() - t2) * 1e3
        stats.items_out = n_recv
        stats.bytes_out = n_recv * self.spec.record_bytes
        return out


class _WeightsState:
    """Versioned, packed module state for the learner-to-actor broadcast (no pickle)."""

    def __init__(self) -> None:
        self.version = 0
        self.buf: torch.Tensor | None = None
        self.broadcast = 0  # last version broadcast (the same on every rank)

    @property
    def nbytes(self) -> int:
        return 0 if self.buf is None else self.buf.numel()

    @staticmethod
    def _layout(module: nn.Module) -> tuple[ExperienceSpec, dict[str, torch.Tensor]]:
        state = {k: v.detach()[None] for k, v in module.state_dict().items()}
        if not state:
            raise SpecError("weights: expected a module with parameters or buffers, got none")
        return ExperienceSpec.from_batch(state, allow_nonfinite=True), state

    def publish(self, module: nn.Module) -> None:
        spec, state = self._layout(module)
        if self.buf is None or self.buf.numel() != spec.record_bytes:
            self.buf = torch.empty(spec.record_bytes, dtype=torch.uint8)
        spec.pack(state, self.buf.view(1, -1))
        self.version += 1

    def exchange(self, ex: Exchange, meta: np.ndarray, src: int, r: int) -> None:
        """Broadcast from ``src`` when its version is newer than the last broadcast (all ranks)."""
        version, nbytes = int(meta[src, 2]), int(meta[src, 3])
        if version <= self.broadcast:
            return
        if ex.rank != src and (self.buf is None or self.buf.numel() != nbytes):
            self.buf = torch.empty(nbytes, dtype=torch.uint8)
        ex.broadcast(self.buf, src, r)
        self.broadcast = self.version = version

    def pull(self, module: nn.Module) -> int:
        if self.version == 0 or self.buf is None:
            return 0
        spec, state = self._layout(module)
        if spec.record_bytes != self.buf.numel():
            raise SpecError(
                f"weights: module state packs to {spec.record_bytes} bytes, the published weights "
                f"are {self.buf.numel()} bytes; is it the learner's architecture?"
            )
        fields = spec.unpack(self.buf.view(1, -1))
        with torch.no_grad():
            for name, t in state.items():
                t.copy_(fields[name])
        return self.version


def _unwrap(module: nn.Module) -> nn.Module:
    return module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module
