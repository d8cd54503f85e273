"""The producer side of a plane: ``put`` (copying or donating), ``staged`` (in place), lag rules.

Items put between two rounds are staged in one of two host buffers (pinned on CUDA machines) that
the next round ingests, so ``put`` never waits for a collective; on CUDA, items put from GPU
tensors go to one of two device buffers instead (packed there, no host round trip). Where items
stay where they were put (world size 1; the fused schedule), ``put`` writes straight into the
rows the shard reserves for them (``Storage.reserve``: no second copy; a tiered shard reserves
free slots of its first tier, and when it has none the items are staged): they count from the
next round on, as staged items do. Every item is tagged with its policy version (the reserved
``"_version"`` field, from ``PolicyVersions``). Staging is bounded by the global
store's capacity: items beyond it would be evicted by the next round anyway, so ``put`` drops
the oldest staged items first (counted in ``dropped``), and ``staged`` refuses a block that does
not fit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch

from conduit_dist.errors import ConfigError
from conduit_dist.records.buffers import DoubleBuffer, Prefixes, RecordBuffer
from conduit_dist.records.spec import VERSION, ExperienceSpec
from conduit_dist.sched.scheduler import Scheduler, now
from conduit_dist.sched.timeline import Timeline


class Stager:
    """Stages a rank's items for the next round.

    Args:
        spec: the record layout.
        shard: this rank's shard (written into directly at world size 1 over one tier).
        world: number of ranks.
        limit: items staged between two rounds at most (the global store's capacity).
        sched: the plane's scheduler (is a round in flight?).
        max_lag: ``0`` forbids staging once the next fetch's round was launched.
        timeline: where ``put`` spans are recorded.
        device: the plane's device: on CUDA, items put from GPU tensors are staged (and packed,
            with batched device copies) in device memory, host tensors in pinned host memory.
        versions: the rank's policy versions (what items are tagged with by default).
        local: items stay on this rank's shard (world size 1, the fused schedule): ``put``
            writes into the rows the shard reserves.
        reads: ``reads(first, rows)``: told the records ``put`` writes into the shard, with
            the generation of the first (a device-rows sampler's host copy of a few columns,
            ``rounds.ingest.Ingest``); ``None``: nobody reads them.
    """

    def __init__(
        self,
        spec: ExperienceSpec,
        shard: object,
        world: int,
        limit: int,
        sched: Scheduler,
        max_lag: int,
        timeline: Timeline,
        device: torch.device,
        versions,
        local: bool = False,
        reads=None,
    ) -> None:
        self.spec, self.shard, self.sched, self.timeline = spec, shard, sched, timeline
        self.reads = reads
        # what a producer puts: the stored fields but the "_version" the stager writes itself
        self.user_spec = ExperienceSpec([f for f in spec.fields.values() if not f.reserved])
        self.versions = versions
        self.limit, self.max_lag = limit, max_lag
        self.direct_ok = world == 1 or local
        cuda = device.type == "cuda"
        self.buffers = DoubleBuffer(spec.record_bytes, torch.device("cpu"), pin_memory=cuda)
        self.device_buffers = DoubleBuffer(spec.record_bytes, device) if cuda else None
        slots = shard.tiers[0].data.device  # where direct writes land
        # CUDA anywhere: direct writes only from tensors already on the slots' device
        self._slots_on = slots if cuda or slots.type != "cpu" else None
        self.direct = 0  # items written straight into storage slots, counted at the next round
        self.put_seq = 0  # puts so far (a fetched batch's lag is measured against it)
        self.in_block = False  # inside a staged() block
        self.dropped = 0  # staged items dropped oldest-first to stay under the limit
        # per device: a reused column (packed at once), its host view, its views by length
        self._version_cols: dict[torch.device, Prefixes] = {}

    @property
    def pending(self) -> int:
        """Items put since the last round was prepared."""
        dev = self.device_buffers.current.count if self.device_buffers is not None else 0
        return self.direct + self.buffers.current.count + dev

    def _stage_for(self, batch: Mapping[str, torch.Tensor]) -> RecordBuffer:
        """Device staging for a batch whose tensors are all on the GPU while nothing is staged
        on the host this round, else host staging: a round ingests device staging first, so
        items keep their put order (a stream's windows depend on it)."""
        if (
            self.device_buffers is not None
            and not self.buffers.current.count
            and all(t.is_cuda for t in batch.values())
        ):
            return self.device_buffers.current
        return self.buffers.current

    def put(
        self, batch: Mapping[str, torch.Tensor], donate: bool = False, version: int | None = None
    ) -> None:
        """Validate ``batch`` and stage it (see :meth:`DataPlane.put`), every item tagged with
        ``version`` (default: the versions' tag); a rejected batch leaves staging and storage
        exactly as before."""
        t0 = now()
        n = self.user_spec.validate(batch)
        v = self.versions.tag if version is None else check_version(version)
        self.check_lag("put")
        first = next(iter(batch.values()))
        batch = {**batch, VERSION: self._version_column(n, v, first.device, donate)}
        if not self._put_direct(batch, n):
            stage = self._stage_for(batch)
            if sum(b.count for b in self._current()) + n > self.limit:  # check, then drop
                self.spec.check_finite(batch)
                skip = self._make_room(stage, n)
                batch, n = {k: v[skip:] for k, v in batch.items()}, n - skip
            if donate:  # checked now, packed by the round
                self.spec.check_finite(batch)
                stage.defer(n, dict(batch))
            else:  # rows count only once committed: a rejected pack leaves none
                self.spec.pack(batch, stage.reserve(n), check=True)
                stage.commit(n)
        self.put_seq += 1
        self.timeline.add("put", Timeline.LEARNER, t0, now(), items=n)

    def _version_column(self, n: int, v: int, device: torch.device, donate: bool) -> torch.Tensor:
        """``n`` copies of the version ``v``: a view of a reused column where the put packs at
        once, a new tensor where it donates (a donated batch is packed by the round, later)."""
        if donate:
            return torch.full((n,), v, dtype=torch.int64, device=device)
        col = self._version_cols.get(device)
        if col is None:
            col = self._version_cols[device] = Prefixes(torch.int64, device)
        view = col.first(n)
        if col.host is not None:
            col.host[:n] = v  # numpy's fill: ~0.3 us where torch's fill_ costs ~2
        else:
            view.fill_(v)
        return view

    def _put_direct(self, batch: Mapping[str, torch.Tensor], n: int) -> bool:
        """Where items stay local, no round is in flight and nothing is staged: pack into the
        rows the shard reserves for the next round; returns whether it did (``False``: stage)."""
        if not self.direct_ok or self.sched.pending is not None or self.buffers.current.count:
            return False  # written ahead only before anything is staged
        if self._slots_on is not None and any(t.device != self._slots_on for t in batch.values()):
            return False  # a copy across devices per field would wait for the GPU: stage it
        if self.device_buffers is not None and self.device_buffers.current.count:
            return False
        got = self.shard.reserve(self.direct, n)
        if got is None:  # e.g. a tiered shard whose first tier has no free slots
            return False
        skip, views = got
        # the rows are written only once the batch is known to be finite: a rejected put leaves
        # the storage as it was, the live items it would overwrite and the free rows alike
        self.spec.check_finite(batch)
        at = skip
        first = self.shard.written + self.direct  # the generation of the batch's first item
        for view in views:
            rows = view.shape[0]
            part = batch if rows == n else {k: v[at : at + rows] for k, v in batch.items()}
            self.spec.pack(part, view, check=False)
            if self.reads is not None:
                self.reads(first + at, view)
            at += rows
        self.direct += n
        return True

    @contextlib.contextmanager
    def staged(self, n: int, version: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """Writable staging rows for ``n`` items (see :meth:`DataPlane.staged`), tagged with
        ``version`` (default: the versions' tag)."""
        v = self.versions.tag if version is None else check_version(version)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"staged: n must be an int >= 1, got {n!r}")
        if self.in_block:
            raise ConfigError("staged: a staged() block is open already; leave it first")
        self.check_lag("staged")
        t0 = now()
        stage = self.buffers.current
        self._check_limit(stage.count + n)
        rows = stage.reserve(n)
        self.in_block = True
        try:
            views = self.spec.unpack(rows)
            views.pop(VERSION).fill_(v)
            yield views
            self.spec.check_records_finite(rows)
            stage.commit(n)
        finally:
            self.in_block = False
        self.put_seq += 1
        self.timeline.add("put", Timeline.LEARNER, t0, now(), items=n)

    def state_dict(self) -> dict[str, int]:
        """Items dropped at staging so far (nothing is staged between rounds when a state is
        taken)."""
        return {"dropped": self.dropped}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore :meth:`state_dict`."""
        self.dropped = int(state["dropped"])

    def take(self) -> tuple[RecordBuffer, RecordBuffer | None, int]:
        """Hand this round's host and device staging and direct-write count to a round."""
        direct, self.direct = self.direct, 0
        dev = self.device_buffers.take() if self.device_buffers is not None else None
        return self.buffers.take(), dev, direct

    def check_lag(self, op: str) -> None:
        """With ``max_lag=0``, refuse items the already launched next round would miss.

        Raises:
            ConfigError: when the round for the next fetch is in flight.
        """
        pending = self.sched.pending
        if self.max_lag == 0 and pending is not None and pending.kind == "prefetch":
            raise ConfigError(
                f"{op}: max_lag=0, but the round for the next fetch was launched already "
                "(fetch(..., more=True) or fetch_start); put before the first fetch of an "
                "iteration, or use max_lag=1"
            )

    def _make_room(self, stage: RecordBuffer, n: int) -> int:
        """Drop the oldest staged items so ``n`` more fit under the limit; returns how many of
        the new batch's own oldest items are dropped too. On CUDA the other staging (host or
        device) gives up its items first; order is kept within each."""
        other = [b for b in self._current() if b is not stage]
        over = sum(b.count for b in self._current()) + n - self.limit
        for buf in (*other, stage):
            k = min(over, buf.count)
            if k > 0:
                buf.pack_deferred(self.spec)
                buf.drop_oldest(k)
                self.dropped += k
                over -= k
        self.dropped += max(over, 0)
        return max(over, 0)

    def _current(self) -> tuple[RecordBuffer, ...]:
        if self.device_buffers is None:
            return (self.buffers.current,)
        return (self.buffers.current, self.device_buffers.current)

    def _check_limit(self, total: int) -> None:
        if total > self.limit:
            raise ConfigError(
                f"staged: {total} items would be staged since the last round, over the staging "
                f"limit of {self.limit} (the global store's capacity); run a round (fetch or "
                "flush) first, or stage fewer items"
            )


def check_version(version: object) -> int:
    """A ``put``'s ``version`` as an int.

    Raises:
        ConfigError: unless a non-negative int.
    """
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ConfigError(f"put version: expected an int >= 0, got {version!r}")
    return version
