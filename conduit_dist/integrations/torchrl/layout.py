"""A TensorDict's leaves as the plane's fields, and back.

A leaf at the nested key ``("next", "observation")`` is stored as the field
``"next.observation"``; ``Layout.nest`` rebuilds the nested TensorDict from a fetched batch
(views, no copy). Keys that ``ShardedReplayBuffer.sample`` adds (``RESERVED``), keys starting
with ``_`` (the plane's) and parts containing ``"."`` are refused, as are dtypes the plane does
not store (``spec.SUPPORTED``: floats, ints, uint8 and bool; no conversion is made).
"""

from __future__ import annotations

import torch
from tensordict import TensorDict, TensorDictBase

from conduit_dist.errors import ConfigError, SpecError
from conduit_dist.records.spec import SUPPORTED, ExperienceSpec, FieldSpec

SEP = "."  # nested keys become field names joined by it
RESERVED = ("index", "priority_weight", "_weight", "_version")  # keys sample() adds
Key = tuple[str, ...]
Shape = tuple[tuple[int, ...], torch.dtype]  # per-item shape, dtype


def show(key: Key) -> str | Key:
    """A key as TorchRL users write it: ``"action"`` or ``("next", "reward")``."""
    return key[0] if len(key) == 1 else key


def flatten(td: TensorDictBase) -> dict[Key, torch.Tensor]:
    """``td``'s leaves as ``key tuple -> tensor``.

    Args:
        td: a TensorDict with one non-empty batch dimension.

    Returns:
        Every leaf under its full key (``("action",)``, ``("next", "reward")``).

    Raises:
        SpecError: naming the key that is reserved, holds no tensor or has a dtype the plane
            does not store; or on another batch shape.

    Example:
        >>> flatten(TensorDict({"next": {"r": torch.ones(2)}}, batch_size=[2]))
        {('next', 'r'): tensor([1., 1.])}
    """
    if not isinstance(td, TensorDictBase):
        raise SpecError(f"extend: expected a TensorDict, got {type(td).__name__}")
    if td.batch_dims != 1 or td.batch_size[0] < 1:
        raise SpecError(
            f"extend: expected a TensorDict with one non-empty batch dimension, got batch_size "
            f"{list(td.batch_size)} (call td.reshape(-1) first)"
        )
    out = {}
    for key, value in td.items(include_nested=True, leaves_only=True):
        key = (key,) if isinstance(key, str) else tuple(key)
        if key[0] in RESERVED or key[0].startswith("_"):
            raise SpecError(
                f"extend: key {show(key)!r} is reserved (sample() returns {list(RESERVED)}; "
                "names starting with '_' belong to the plane); drop or rename it"
            )
        if any(SEP in part for part in key):
            raise SpecError(f"extend: key {show(key)!r} contains {SEP!r}, which joins nested keys")
        if not isinstance(value, torch.Tensor) or type(value).__name__.startswith("NonTensor"):
            raise SpecError(f"extend: key {show(key)!r} holds {type(value).__name__}, not a tensor")
        if value.dtype not in SUPPORTED:
            raise SpecError(
                f"extend: key {show(key)!r}: dtype {value.dtype} is not stored (supported: "
                f"{[str(d) for d in SUPPORTED]}); convert it first"
            )
        out[key] = value
    return out


class Layout:
    """The keys, per-item shapes and dtypes of the stored TensorDicts, in field order.

    Args:
        fields: ``key tuple -> (per-item shape, dtype)``.

    Raises:
        SpecError: if the fields do not make an ``ExperienceSpec`` (naming the field).

    Example:
        >>> lay = Layout.of(flatten(TensorDict({"obs": torch.zeros(3, 4)}, batch_size=[3])))
        >>> lay.spec
        ExperienceSpec(obs: [4] torch.float32; record_bytes=16)
    """

    def __init__(self, fields: dict[Key, Shape]) -> None:
        self.fields = {tuple(k): (tuple(s), d) for k, (s, d) in fields.items()}
        self.spec = ExperienceSpec(
            [FieldSpec(SEP.join(k), s, d) for k, (s, d) in self.fields.items()]
        )
        self._tree = [(k[:-1], k[-1], SEP.join(k)) for k in self.fields]

    @classmethod
    def of(cls, flat: dict[Key, torch.Tensor]) -> Layout:
        """The layout of a flattened batch (items are its leading dimension)."""
        return cls({k: (tuple(v.shape[1:]), v.dtype) for k, v in flat.items()})

    @classmethod
    def from_spec(cls, spec: ExperienceSpec) -> Layout:
        """An existing plane's layout: field names split at ``"."`` are the keys."""
        return cls({tuple(n.split(SEP)): (f.shape, f.dtype) for n, f in spec.fields.items()})

    def state(self) -> list[list[object]]:
        """``[[key parts], [shape], dtype name]`` per field: strings and ints only."""
        return [[list(k), list(s), str(d)] for k, (s, d) in self.fields.items()]

    @classmethod
    def from_state(cls, state: list[list[object]]) -> Layout:
        """The inverse of :meth:`state`. ``ConfigError`` on an unknown dtype name."""
        names = {str(d): d for d in SUPPORTED}
        for _, _, d in state:
            if d not in names:
                raise ConfigError(f"load_state_dict: unknown dtype {d!r} in the saved layout")
        return cls({tuple(k): (tuple(s), names[d]) for k, s, d in state})

    def describe(self) -> list[tuple[Key, tuple[int, ...], str]]:
        """A sorted, comparable summary (what the ranks compare before building the plane)."""
        return sorted((k, s, str(d)) for k, (s, d) in self.fields.items())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self.fields == other.fields

    __hash__ = None  # type: ignore[assignment]

    def to_fields(self, flat: dict[Key, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The plane's ``name -> tensor`` batch of a flattened one.

        Raises:
            SpecError: naming the missing or unexpected keys, or the key whose dtype or
                per-item shape differs from the layout's.
        """
        if flat.keys() != self.fields.keys():
            missing = [show(k) for k in sorted(self.fields.keys() - flat.keys())]
            extra = [show(k) for k in sorted(flat.keys() - self.fields.keys())]
            raise SpecError(
                f"extend: keys differ from the first batch's: missing {missing}, unexpected {extra}"
            )
        for key, (shape, dtype) in self.fields.items():
            got = flat[key]
            if got.dtype != dtype or tuple(got.shape[1:]) != shape:
                dims = ", ".join(["N", *map(str, shape)])
                raise SpecError(
                    f"extend: key {show(key)!r}: expected {dtype} [{dims}] (the first batch's), "
                    f"got {got.dtype} {list(got.shape)}"
                )
        return {SEP.join(k): v for k, v in flat.items()}

    def nest(
        self, out: dict[str, torch.Tensor], extra: dict[str, torch.Tensor], device: torch.device
    ) -> TensorDict:
        """A fetched batch (``name -> [B, ...]``) as a nested TensorDict on ``device``, with
        ``extra``'s top-level entries beside the fields."""
        root: dict = dict(extra)
        for parents, leaf, name in self._tree:
            at = root
            for part in parents:
                at = at.setdefault(part, {})
            at[leaf] = out[name]
        batch = next(iter(out.values())).shape[0]
        return TensorDict(root, batch_size=[batch], device=device)
