"""``ShardedReplayBuffer``: TorchRL's ``TensorDictReplayBuffer`` calls over the sharded plane.

Collective, as under DDP (SPMD): every rank calls ``extend``, ``sample``, ``state_dict``,
``load_state_dict`` and ``close`` the same number of times, in the same order. Each ``extend``
and each ``sample`` runs one round of the plane; the plane itself is built at the first
``extend`` (from that TensorDict's keys, dtypes and shapes), so every rank's first ``extend``
must happen at the same point. Nested keys such as ``("next", "observation")`` are stored as
the fields ``"next.observation"`` and come back nested.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from tensordict import TensorDictBase

from conduit_dist.errors import ConfigError, SpecError
from conduit_dist.integrations.torchrl.layout import Key, Layout, flatten
from conduit_dist.integrations.torchrl.unsupported import (
    UNSUPPORTED,
    check_plane_kwargs,
    check_sampler,
)
from conduit_dist.plane import DataPlane
from conduit_dist.registry import check_count
from conduit_dist.sampling import RoutesFeedback, Sampler


class ShardedReplayBuffer:
    """A TorchRL-compatible replay buffer whose storage is the sharded :class:`DataPlane`.

    Args:
        capacity_per_rank: items each rank's shard holds (the global capacity is this times the
            world size; the oldest items are evicted first).
        batch_size: this rank's default ``sample`` size (``None``: ``sample`` must be given one).
            The update's global batch is this times the number of learners.
        sampler: ``"uniform"``, ``"prioritized"`` (``cd.Prioritized()``) or a conduit_dist
            sampler, e.g. ``cd.Prioritized(alpha=0.6, beta=0.4)``.
        priority_key: the key ``update_tensordict_priority`` reads (TorchRL's ``"td_error"``).
        seed: the plane's seed.
        **plane_kwargs: further :class:`DataPlane` arguments (defaults here: ``placement=
            "local"``: one exchange per round, as every rank learns; and ``schedule="sync"``:
            no module is attached, so there is no backward to overlap a round with).

    Raises:
        ConfigError: on a bad argument, naming it.
        NotImplementedError: on a TorchRL argument that has no meaning here (e.g. ``storage=
            LazyTensorStorage(...)`` or a TorchRL sampler), saying what to pass instead.

    Example:
        >>> rb = ShardedReplayBuffer(1000, batch_size=32)
        >>> rb.extend(TensorDict({"obs": torch.randn(64, 4)}, batch_size=[64]))
        >>> len(rb), rb.sample()["obs"].shape
        (64, torch.Size([32, 4]))
        >>> rb.close()
    """

    def __init__(
        self,
        capacity_per_rank: int,
        *,
        batch_size: int | None = None,
        sampler: str | Sampler = "uniform",
        priority_key: str | Key = "td_error",
        seed: int = 0,
        **plane_kwargs: object,
    ) -> None:
        check_plane_kwargs(plane_kwargs)
        check_count("capacity_per_rank", capacity_per_rank, 1)
        if batch_size is not None:
            check_count("batch_size", batch_size, 1)
        self.capacity_per_rank, self.batch_size, self.seed = capacity_per_rank, batch_size, seed
        self.priority_key = priority_key
        self._sampler = check_sampler(sampler)
        self._plane_kwargs = {"placement": "local", "schedule": "sync", **plane_kwargs}
        self.layout: Layout | None = None  # the stored keys, set when the plane is built
        self.plane: DataPlane | None = None

    @classmethod
    def from_plane(
        cls,
        plane: DataPlane,
        *,
        batch_size: int | None = None,
        priority_key: str | Key = "td_error",
    ) -> ShardedReplayBuffer:
        """Wrap an existing plane whose field names are keys joined by ``"."``
        (``"next.observation"`` is ``("next", "observation")``). Closing the buffer closes it."""
        if not isinstance(plane, DataPlane):
            raise ConfigError(f"from_plane: expected a DataPlane, got {type(plane).__name__}")
        rb = cls(plane.capacity_per_rank, batch_size=batch_size, priority_key=priority_key)
        rb._sampler, rb.plane = plane.sampler, plane
        rb.layout = Layout.from_spec(plane.spec)
        return rb

    # ---------------------------------------------------------------- TorchRL's API

    def extend(self, tensordicts: TensorDictBase, *, update_priority: bool | None = None) -> None:
        """Store a batch and run a round, so ``len(rb)`` counts it on every rank (collective).

        The first call builds the plane from this TensorDict's leaves (keys, dtypes, per-item
        shapes): every rank's first ``extend`` must happen at the same point, and the ranks
        must agree on the layout. A rank whose batch is refused still takes part in the round
        (storing nothing), then raises, so the ranks stay in step.

        Args:
            tensordicts: ``[N]`` TensorDict (one batch dimension; nested keys allowed).
            update_priority: TorchRL's flag; ``True`` (or a ``priority_key`` entry with the
                prioritized sampler) is refused: new items get the largest priority so far.

        Returns:
            None (TorchRL returns storage indices; the plane's addresses exist once a round has
            placed the items, and come with ``sample()``).

        Raises:
            SpecError: on a missing, extra or reserved key, or a dtype or shape that differs
                from the first batch's (naming the key); nothing is stored then.
            NotImplementedError: for initial priorities given at ``extend``.
            RoundError: if the round failed on some rank.
        """
        error = None
        try:
            flat = flatten(tensordicts)
            if update_priority or (
                update_priority is None
                and self._routes_updates()
                and tensordicts.get(self.priority_key, None) is not None
            ):
                raise NotImplementedError(
                    f"extend: priorities at insertion (key {self.priority_key!r}) are not "
                    "supported: new items get the largest priority so far; drop the key or "
                    "pass update_priority=False, and call update_priority after sampling"
                )
        except (SpecError, NotImplementedError) as e:
            flat, error = None, e
        if self.plane is None:
            self._build(flat, error)
        elif error is None:
            try:
                self.plane.put(self.layout.to_fields(flat))
            except SpecError as e:
                error = e
        self.plane.flush()
        self.plane.wait()
        if error is not None:
            raise error

    def add(self, data: TensorDictBase) -> None:
        """Store one item (a TensorDict with no batch dimension): ``extend(data.unsqueeze(0))``."""
        self.extend(data.unsqueeze(0))

    def sample(
        self, batch_size: int | None = None, return_info: bool = False
    ) -> TensorDictBase | tuple[TensorDictBase, dict[str, torch.Tensor]]:
        """This rank's batch from the global store (collective: one round).

        Args:
            batch_size: items (default: the buffer's ``batch_size``).
            return_info: also return ``{"index": ..., "priority_weight": ...}`` (TorchRL's).

        Returns:
            A ``TensorDict`` with ``batch_size [B]`` on the plane's device: the stored keys
            (nested again), ``"_version"`` (int64 policy version of each item's producer) and,
            with the prioritized sampler, ``"index"`` (int64 addresses for
            :meth:`update_priority`), ``"priority_weight"`` (float32 importance weights, the
            key TorchRL's losses read) and ``"_weight"`` (the same, the plane's name). The
            uniform sampler delivers no addresses, so no ``"index"``. As with TorchRL's
            samplers, a batch may be larger than the buffer (rows repeat).

        Raises:
            ConfigError: no batch size, or a bad one.
            EmptyStoreError: nothing stored yet.
            RoundError: if the round failed on some rank.
        """
        batch_size = self.batch_size if batch_size is None else batch_size
        if batch_size is None:
            raise ConfigError("sample: batch_size: none given and the buffer has none")
        check_count("sample batch_size", batch_size, 1)
        plane = self._require("sample")
        out = plane.fetch(batch_size, oversample=True)  # as TorchRL's samplers: may repeat
        dev = plane.device
        info = {}
        if "_index" in out:  # the prioritized sampler's addresses and importance weights
            info = {"index": out["_index"].to(dev), "priority_weight": out["_weight"].to(dev)}
        extra = {"_version": out["_version"], **info}
        if info:
            extra["_weight"] = info["priority_weight"]
        td = self.layout.nest(out, extra, dev)
        return (td, info) if return_info else td

    def update_priority(self, index: torch.Tensor, priority: torch.Tensor) -> None:
        """Set the priorities of sampled items (prioritized sampler; see
        ``DataPlane.update_priorities``: each update reaches its shard in a later round).

        Args:
            index: the ``"index"`` entries of sampled batches (int64 ``[k]``).
            priority: ``[k]`` or ``[k, ...]`` (reduced by ``max`` over the trailing dims, as
                TorchRL's default ``reduction``), finite and ``>= 0``.

        Raises:
            ConfigError: without the prioritized sampler, or on bad shapes or values.
        """
        plane = self._require("update_priority")
        if (
            isinstance(priority, torch.Tensor)
            and isinstance(index, torch.Tensor)
            and priority.dim() > 1
            and priority.shape[:1] == index.shape[:1]
        ):
            priority = priority.reshape(priority.shape[0], -1).amax(dim=1)
        plane.update_priorities(index, priority)

    def update_tensordict_priority(self, data: TensorDictBase) -> None:
        """``update_priority(data["index"], data[priority_key])`` (TorchRL's name).

        Raises:
            KeyError: when ``data`` has no ``"index"`` or no ``priority_key`` entry.
            ConfigError: without the prioritized sampler (TorchRL would do nothing then).
        """
        if not self._routes_updates():
            raise ConfigError(
                f"update_tensordict_priority: the {self._sampler_name()!r} sampler takes no "
                "priorities; build the buffer with sampler=cd.Prioritized(alpha > 0)"
            )
        for key in ("index", self.priority_key):
            if data.get(key, None) is None:
                raise KeyError(f"update_tensordict_priority: data has no {key!r} entry")
        self.update_priority(data.get("index"), data.get(self.priority_key))

    def __len__(self) -> int:
        """Items stored over all shards (as of the latest round: every extend runs one)."""
        return 0 if self.plane is None else len(self.plane)

    @property
    def sampler(self) -> Sampler | str:
        """The conduit_dist sampler (e.g. ``rb.sampler.beta = b`` to anneal beta)."""
        return self.plane.sampler if self.plane is not None else self._sampler

    # ---------------------------------------------------------------- state and lifetime

    def state_dict(self) -> dict[str, object]:
        """This rank's state: the plane's and the layout (tensors, ints and strings: loads with
        ``torch.load(..., weights_only=True)``). Call it at the same point on every rank."""
        return {
            "plane": None if self.plane is None else self.plane.state_dict(),
            "facade": {
                "capacity_per_rank": self.capacity_per_rank,
                "batch_size": self.batch_size,
                "fields": None if self.layout is None else self.layout.state(),
            },
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict` (collective; builds the plane from the saved layout when
        no ``extend`` has built it yet).

        Raises:
            ConfigError: on another capacity, layout or world size (see
                ``DataPlane.load_state_dict``).
        """
        facade = state["facade"]
        if facade["capacity_per_rank"] != self.capacity_per_rank:
            raise ConfigError(
                f"load_state_dict capacity_per_rank: saved {facade['capacity_per_rank']}, "
                f"buffer has {self.capacity_per_rank}"
            )
        if facade["fields"] is None:
            if self.plane is not None or state["plane"] is not None:
                raise ConfigError(
                    "load_state_dict: the saved buffer held nothing; this one has a plane"
                )
            return
        saved = Layout.from_state(facade["fields"])
        if self.plane is None:
            self.layout = saved
            self.plane = self._make_plane()
        if saved != self.layout:
            raise ConfigError(
                f"load_state_dict fields: saved {saved.describe()}, buffer has "
                f"{self.layout.describe()}"
            )
        if state["plane"] is not None:
            self.plane.load_state_dict(state["plane"])

    def close(self) -> None:
        """Close the plane (collective; safe to call twice)."""
        if self.plane is not None:
            self.plane.close()

    def __enter__(self) -> ShardedReplayBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        world = "?" if self.plane is None else self.plane.world
        keys = None if self.layout is None else list(self.layout.spec.fields)
        return (
            f"ShardedReplayBuffer(len={len(self)}, capacity_per_rank={self.capacity_per_rank}, "
            f"world={world}, batch_size={self.batch_size}, sampler={self._sampler_name()!r}, "
            f"fields={keys})"
        )

    # ---------------------------------------------------------------- what is not supported

    def __getattr__(self, name: str) -> object:
        if name in UNSUPPORTED:
            raise NotImplementedError(f"ShardedReplayBuffer.{name}: {UNSUPPORTED[name]}")
        raise AttributeError(f"'ShardedReplayBuffer' object has no attribute {name!r}")

    def __getitem__(self, index: object) -> object:
        raise NotImplementedError(
            "ShardedReplayBuffer[...]: items live on several ranks' shards and have no global "
            "position; use sample()"
        )

    def __setitem__(self, index: object, value: object) -> None:
        raise NotImplementedError("ShardedReplayBuffer[...] = ...: items are written by extend")

    def __iter__(self) -> Iterator[TensorDictBase]:
        raise NotImplementedError(
            "iter(ShardedReplayBuffer): call sample() once per update (each is a collective "
            "round), or use cd.ExperienceLoader over rb.plane"
        )

    # ---------------------------------------------------------------- internals

    def _build(self, flat: dict[Key, torch.Tensor] | None, error: Exception | None) -> None:
        """Build the plane from the first batch, once every rank agreed on its layout (one
        ``all_gather_object``: a rank whose batch was refused makes every rank raise)."""
        layout = None
        if error is None:
            try:
                layout = Layout.of(flat)
            except SpecError as e:
                error = e
        mine = repr(error) if error is not None else layout.describe()
        everyone = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        if error is not None:
            raise error
        bad = {r: _diff(m, mine) for r, m in enumerate(everyone) if m != mine}
        if bad:
            raise SpecError(
                f"extend: the first batch's layout differs between ranks (the plane is built "
                f"from it, collectively): {bad}"
            )
        self.layout = layout
        self.plane = self._make_plane()
        self.plane.put(layout.to_fields(flat))

    def _make_plane(self) -> DataPlane:
        return DataPlane(
            self.layout.spec, self.capacity_per_rank, seed=self.seed, sampler=self._sampler,
            **self._plane_kwargs,
        )  # fmt: skip

    def _require(self, what: str) -> DataPlane:
        if self.plane is None:
            raise ConfigError(
                f"{what}: nothing stored yet; extend the buffer first (on every rank)"
            )
        return self.plane

    def _routes_updates(self) -> bool:
        return isinstance(self.sampler, RoutesFeedback)

    def _sampler_name(self) -> str:
        s = self.sampler
        return s if isinstance(s, str) else s.name


def _diff(theirs: object, mine: list) -> str:
    """How another rank's first-batch layout (or its error) differs from this rank's."""
    if isinstance(theirs, str):
        return f"refused its batch: {theirs}"
    extra, missing = sorted(set(theirs) - set(mine)), sorted(set(mine) - set(theirs))
    return f"has {extra} where this rank has {missing}"
