"""The learner's side of a plane: a fetch's records as fields, checked against the policy-age
bound, and priority updates sent back to the shards that own the items."""

from __future__ import annotations

import torch

from conduit_dist.errors import ConfigError, StaleDataError
from conduit_dist.flow.versions import check_ages, check_max_age
from conduit_dist.plane.waiting import fetch_records
from conduit_dist.records.spec import VERSION
from conduit_dist.sampling.base import RoutesFeedback, WritesRows
from conduit_dist.syncs import wait_event


class Consumer:
    """Turns a learner's delivered rows into its batch.

    Args:
        parts: the plane's parts (``plane/build.py``).
        max_policy_age: the plane's bound (``None``: none).
    """

    def __init__(self, parts, max_policy_age: int | None) -> None:
        self.p, self.max_age = parts, max_policy_age
        self.rank = parts.exchange.rank
        self.all_learn = len(parts.learner_ranks) == parts.exchange.world
        self.stale_refused = 0  # rows of batches refused by check_ages (taken from the store)
        # the sampler's capabilities, checked once (isinstance on a protocol costs ~1 us)
        self._reads = isinstance(parts.sampler, WritesRows)
        self._routes = isinstance(parts.sampler, RoutesFeedback)
        # priority updates given on a GPU (or rehearsing that path on a CPU plane), queued at
        # the next fetch or flush: no device value is read between a forward and its backward
        self._later: list[_Later] = []
        self._refused: ConfigError | None = None  # refused in a collective call, raised next
        plan = parts.engine.devices
        self._rehearse = plan.compose == "torch" and plan.device.type == "cpu"

    def fetch(
        self,
        batch_size: int,
        *,
        more: bool = False,
        reduce: torch.Tensor | None = None,
        max_policy_age: int | None = None,
        wait_s: float = 0.0,
        meta: bool = True,
        oversample: bool = False,
    ) -> dict[str, torch.Tensor]:
        """This learner's batch, drawn by the sampler from the global store.

        Args:
            batch_size: items to return.
            more: another fetch follows before the next ``put`` (minibatches of one rollout).
            reduce: a contiguous, 4-byte aligned CPU float32 ``[reduce_numel]`` tensor that
                does not require grad and is no inference tensor, replaced in place by its mean
                over learners.
            max_policy_age: a bound for this fetch (``None``: the plane's), checked on every
                row against the newest version this rank knew when the round was prepared
                (with actors and a bound >= 1: the one it knew a round earlier, what the actors'
                shards evict by; ``k = 0`` stays strict).
            wait_s: while nothing can be delivered (``EmptyStoreError``), run further rounds for
                up to this many seconds (e.g. a learner waiting for actors).
            meta: ``False``: leave the reserved ``_``-prefixed entries (``_version``,
                ``_index``, ``_weight``) out of the batch (e.g. for ``Transition(**batch)``).
            oversample: ``True``: a replay fetch may ask for more rows than the store holds
                items (rows repeat); ``False``: such a fetch raises ``EmptyStoreError``.

        Returns:
            ``name -> [batch_size, *shape]`` views of one pooled buffer (rows grouped by shard),
            with ``"_version"`` (the producer's policy version) and the sampler's entries
            (``_index``/``_weight``; windows ``[B, T, ...]`` or n-step values) unless ``meta``
            is ``False``.

        Raises:
            ConfigError: on an actor, a bad ``batch_size``, or one above its launched round's.
            RoundError: if the round failed or timed out on some rank (names the rank).
            EmptyStoreError: if nothing can be delivered, or a replay batch is larger than the
                store without ``oversample`` (after ``wait_s``; the rounds themselves completed).
            StaleDataError: if a row is older than the bound (the batch is not returned).
            RateLimitError: held by the rate limiter longer than its ``timeout_s``.
        """
        p = self.p
        self.queue_later()
        bound = check_max_age("fetch max_policy_age", max_policy_age)
        if not isinstance(wait_s, int | float) or not wait_s >= 0 or wait_s == float("inf"):
            raise ConfigError(f"fetch wait_s: expected a finite number >= 0, got {wait_s!r}")
        for name, flag in (("meta", meta), ("oversample", oversample)):
            if not isinstance(flag, bool):
                raise ConfigError(f"fetch {name}: expected True or False, got {flag!r}")
        if p.limiter is not None and isinstance(batch_size, int):
            p.limiter.check_size("sample", batch_size)
        bound = self.max_age if bound is None else bound
        records = fetch_records(p.control, batch_size, more, reduce, wait_s, p.limiter, oversample)
        unpack = p.engine.delivery.outputs.unpack
        # a sampler that composed the rows reads them back (trailers: _index, _weight; windows)
        out = p.sampler.read_rows(records, unpack) if self._reads else unpack(records)
        if bound is not None:
            st = p.clock.stats
            try:
                # with actors, a version learners publish reaches them (and the bound their
                # shards evict by) one round later: a window (bound >= 1) is checked against
                # what every rank knew; bound 0 (on-policy) stays strict
                ref = st.newest if self.all_learn or bound == 0 else st.newest_before
                check_ages(out[VERSION], ref, bound, self.rank, st.round)
            except StaleDataError:
                self.stale_refused += int(out[VERSION].numel())
                raise
        return out if meta else {k: v for k, v in out.items() if not k.startswith("_")}

    def update_priorities(self, index: torch.Tensor, priority: torch.Tensor) -> None:
        """Set the priorities of fetched items (learners; ``Prioritized`` with ``alpha > 0``).

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
        p = self.p
        if self.rank not in p.learner_ranks:
            raise ConfigError(
                f"update_priorities: rank {self.rank} is an actor; learners update what they "
                "fetched"
            )
        if not self._routes:
            raise ConfigError(
                f"update_priorities: the {p.sampler.name!r} sampler takes no priority updates "
                "(its draws do not depend on them); build the plane with "
                "sampler=cd.Prioritized(alpha > 0)"
            )
        index, priority = _check_updates(index, priority)
        if index.is_cuda or self._rehearse:
            self._later.append(_Later(index, priority))
            return
        p.sampler.queue_updates(index, priority)

    def queue_later(self, collective: bool = False) -> None:
        """Queue the updates given on a GPU since the last call (call at the next fetch, flush
        or collective call, never between a forward and its backward): their values were copied
        to pinned memory without blocking, so by now that copy has usually passed (a counted
        host sync when not); the sampler checks them as it queues them.

        Args:
            collective: called from a collective call (a state dict, a checkpoint): a refused
                update does not raise there (the other ranks would wait for this one); its
                error is raised by the next fetch or flush.

        Raises:
            ConfigError: on NaN, infinite or negative priorities, or foreign addresses, naming
                them (that update is dropped; the ones given after it stay for the next call).
        """
        if not collective and self._refused is not None:
            refused, self._refused = self._refused, None
            raise refused
        while self._later:
            later = self._later.pop(0)
            index, priority = later.land()
            try:
                self.p.sampler.queue_updates(index, priority)
            except ConfigError as exc:
                exc.add_note(
                    "(given to update_priorities on a GPU: checked when queued, at the next "
                    "fetch or flush; that update was dropped)"
                )
                if not collective:
                    raise
                self._refused = self._refused or exc


class _Later:
    """Priority updates given on a GPU: addresses and float64 priority bits copied to pinned
    memory on the caller's stream without blocking, read once the copy's event has passed (a
    CPU plane rehearsing the device path keeps them as they are, ``rounds.devices``)."""

    def __init__(self, index: torch.Tensor, priority: torch.Tensor) -> None:
        self.event = None
        if not index.is_cuda:  # the rehearsal: host tensors, read later the same way
            self.both = torch.stack([index, priority.to(torch.float64).view(torch.int64)])
            return
        # CUDA only from here, under the tensors' device (the caller's thread may have another
        # current device: the pinned block and the event belong to this one's context)
        with torch.cuda.device(index.device):
            bits = priority.to(torch.float64).view(torch.int64)
            self.both = torch.empty((2, index.numel()), dtype=torch.int64, pin_memory=True)
            self.both.copy_(torch.stack([index, bits]), non_blocking=True)
            self.event = torch.cuda.current_stream(index.device).record_event()

    def land(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index int64, priority float64)`` host tensors, once the copy has landed."""
        wait_event(self.event, "priority updates")
        return self.both[0], self.both[1].view(torch.float64)


def _check_updates(index, priority) -> tuple[torch.Tensor, torch.Tensor]:
    """``update_priorities``' arguments as contiguous int64 and floating ``[k]`` tensors on one
    device: host tensors (their values are checked by the sampler; the queue converts to float64
    in a reused buffer), or both on one GPU, left there (copied to the host without blocking by
    :class:`_Later`); on two devices, moved to the host.

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
    index, priority = index.detach(), priority.detach()
    if index.device == priority.device and index.is_cuda:
        return index, priority  # read later, without a sync now (_Later)
    return index.to("cpu").contiguous(), priority.to("cpu").contiguous()
