"""Experience specification: named fields, their validation, and the spec they make.

:class:`FieldSpec` is one named field (shape, dtype, whether NaN/inf are accepted);
:class:`ExperienceSpec` is the fields of one experience item: built from a mapping or inferred
from a batch, it checks batches against them (:meth:`ExperienceSpec.validate`). Its packed
record layout, ``pack`` / ``unpack`` and the NaN/inf scans come from its base class
:class:`~conduit_dist.records.layout.RecordLayout` (``records/layout.py``); the C extension is
loaded in ``records/native.py`` and re-exported here as ``_native``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from conduit_dist.errors import SpecError
from conduit_dist.records.layout import ALIGN as ALIGN
from conduit_dist.records.layout import RecordLayout
from conduit_dist.records.layout import align as align
from conduit_dist.records.native import _native as _native

SUPPORTED = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
)


VERSION = "_version"  # the stored field every item carries: its producer's policy version


@dataclass(frozen=True)
class FieldSpec:
    """One named field of an experience item.

    Args:
        name: field name, the key of the batch dict.
        shape: per-item shape (without the leading batch dimension); ``()`` for scalars.
        dtype: element dtype.
        allow_nonfinite: accept NaN/inf in a floating field (rejected by default).
        reserved: the plane's own ``"_version"`` field (user fields may not start with ``_``).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    allow_nonfinite: bool = False
    reserved: bool = dataclasses.field(default=False, repr=False)  # the plane's own fields

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise SpecError(f"field name must be a non-empty string, got {self.name!r}")
        if self.name.startswith("_") and not (self.reserved and self.name == VERSION):
            raise SpecError(
                f"field {self.name!r}: names starting with '_' are reserved for what the plane "
                "returns beside the fields (e.g. '_index', '_weight'); rename the field"
            )
        if self.dtype not in SUPPORTED:
            raise SpecError(
                f"field {self.name!r}: dtype must be one of {[str(d) for d in SUPPORTED]}, "
                f"got {self.dtype}"
            )
        shape = tuple(int(s) for s in self.shape)
        if any(s <= 0 for s in shape):
            raise SpecError(f"field {self.name!r}: shape must be positive, got {shape}")
        object.__setattr__(self, "shape", shape)

    @property
    def numel(self) -> int:
        """Elements per item."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes per item."""
        return self.numel * self.dtype.itemsize

    @property
    def is_float(self) -> bool:
        """Whether the field holds floating-point values."""
        return self.dtype.is_floating_point


class ExperienceSpec(RecordLayout):
    """Named fields of one experience item and their packed record layout.

    Fields are laid out by descending element size, each at an 8-byte aligned offset.

    Args:
        fields: a mapping ``name -> (shape, dtype)`` or a sequence of :class:`FieldSpec`.
        allow_nonfinite: default for floating fields given as ``(shape, dtype)`` tuples.

    Raises:
        SpecError: on an empty spec, a duplicate name, an unsupported dtype or a bad shape.

    Example:
        >>> spec = ExperienceSpec({"obs": ((4,), torch.float32), "action": ((), torch.int64)})
        >>> spec.record_bytes
        24
    """

    def __init__(
        self,
        fields: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | list[FieldSpec],
        allow_nonfinite: bool = False,
    ) -> None:
        if isinstance(fields, Mapping):
            ragged = [n for n, f in fields.items() if type(f).__name__ == "Ragged"]
            if ragged:
                raise SpecError(
                    f"fields {ragged}: variable-length (Ragged) fields are stored by "
                    "cd.TokenSpec and delivered by cd.TokenPlane (token arenas, prompt groups, "
                    "token-balanced micro-batches); an ExperienceSpec holds fixed-size fields"
                )
            fields = [FieldSpec(n, tuple(s), d, allow_nonfinite) for n, (s, d) in fields.items()]
        fields = list(fields)
        if not fields:
            raise SpecError("an ExperienceSpec needs at least one field, got none")
        names = [f.name for f in fields]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise SpecError(f"field names must be unique, got duplicates {sorted(dup)}")
        self.fields: dict[str, FieldSpec] = {f.name: f for f in fields}
        super().__init__(fields)

    def with_version(self) -> ExperienceSpec:
        """This spec plus the reserved int64 field ``"_version"`` (the policy version of the
        item's producer; the plane stores it with every item and returns it with every row)."""
        version = FieldSpec(VERSION, (), torch.int64, reserved=True)
        return ExperienceSpec([*self.fields.values(), version])

    @classmethod
    def from_batch(
        cls, batch: Mapping[str, torch.Tensor], allow_nonfinite: bool = False
    ) -> ExperienceSpec:
        """Infer a spec from a dict of tensors that share a leading batch dimension.

        Args:
            batch: ``name -> tensor`` with shape ``[B, *item_shape]``.
            allow_nonfinite: accept NaN/inf in floating fields.

        Returns:
            The spec whose fields have the per-item shapes and dtypes of ``batch``.

        Raises:
            SpecError: if ``batch`` is empty or a value is not a tensor with a batch dimension.
        """
        if not isinstance(batch, Mapping) or not batch:
            raise SpecError(
                f"batch must be a non-empty dict of tensors, got {type(batch).__name__}"
            )
        fields = []
        for name, t in batch.items():
            if not isinstance(t, torch.Tensor) or t.dim() < 1:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise SpecError(
                    f"field {name!r}: expected a tensor with a leading batch dim, got {got}"
                )
            fields.append(FieldSpec(name, tuple(t.shape[1:]), t.dtype, allow_nonfinite))
        return cls(fields)

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}: {list(f.shape)} {f.dtype}" for n, f in self.fields.items())
        return f"ExperienceSpec({inner}; record_bytes={self.record_bytes})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ExperienceSpec) and self.fields == other.fields

    __hash__ = None  # type: ignore[assignment]

    @property
    def payload_bytes(self) -> int:
        """Raw experience bytes per item (without alignment padding)."""
        return sum(f.nbytes for f in self.fields.values())

    def validate(self, batch: Mapping[str, torch.Tensor]) -> int:
        """Check names, dtypes, shapes and batch sizes of ``batch`` (not values).

        Args:
            batch: ``name -> tensor`` with a shared leading batch dimension.

        Returns:
            The batch size.

        Raises:
            SpecError: naming the field, the expected and the received value.
        """
        if type(batch) is not dict and not isinstance(batch, Mapping):  # ABC check is slow
            raise SpecError(f"batch: expected a dict of tensors, got {type(batch).__name__}")
        if batch.keys() != self.fields.keys():
            missing = sorted(self.fields.keys() - batch.keys())
            extra = sorted(batch.keys() - self.fields.keys(), key=repr)  # any hashable key
            raise SpecError(
                f"batch fields do not match the spec: missing {missing}, unexpected {extra} "
                f"(expected {sorted(self.fields)})"
            )
        n = -1
        for name, f in self.fields.items():
            t = batch[name]
            if not isinstance(t, torch.Tensor):
                raise SpecError(f"field {name!r}: expected a torch.Tensor, got {type(t).__name__}")
            if t.dtype != f.dtype:
                raise SpecError(f"field {name!r}: expected dtype {f.dtype}, got {t.dtype}")
            if t.layout is not torch.strided or t.is_meta:  # packing reads the data directly
                raise SpecError(
                    f"field {name!r}: expected a dense tensor with data, got layout {t.layout} "
                    f"on {t.device}"
                )
            if t.dim() != len(f.shape) + 1 or t.shape[1:] != f.shape:
                raise SpecError(
                    f"field {name!r}: expected shape [B, {', '.join(map(str, f.shape))}], "
                    f"got {list(t.shape)}"
                )
            if n < 0:
                n, first = t.shape[0], name
            elif t.shape[0] != n:
                raise SpecError(
                    f"field {name!r}: leading dimension {t.shape[0]} disagrees with "
                    f"field {first!r} ({n})"
                )
        if n == 0:
            raise SpecError("batch is empty: expected at least one item, got leading dim 0")
        return n

    def state_dict(self) -> dict[str, object]:
        """A plain description (names, shapes, dtype names) usable without pickle."""
        return {
            n: {"shape": list(f.shape), "dtype": str(f.dtype), "allow_nonfinite": f.allow_nonfinite}
            for n, f in self.fields.items()
        }
