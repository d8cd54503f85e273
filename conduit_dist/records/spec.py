"""Experience specification: named fields, validation, and the fixed-size record layout.

Every item of experience is stored as one *record*: a row of ``record_bytes`` bytes in which each
field sits at an offset aligned to 8 bytes. Storage, the wire format and delivery buffers are all
``[n, record_bytes]`` ``uint8`` tensors, so ingestion and delivery are plain byte copies, and a
received batch is viewed field by field with ``Tensor.view(dtype)`` on aligned column slices.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from conduit_dist.errors import SpecError

try:
    from conduit_dist._native import _pack as _native
except ImportError:  # a source checkout that was not built: pip install -e .
    _native = None
    logging.getLogger("conduit_dist").warning(
        "conduit_dist._native._pack is not built (run pip install -e .): packing records uses "
        "torch's strided copies, slower for small fields"
    )

ALIGN = 8  # bytes: field offsets and record sizes are multiples of it
_NATIVE_MAX_FIELDS = 256  # MAX_FIELDS in _native/pack.c
_KIND = {torch.float32: 4, torch.float64: 8, torch.float16: 2, torch.bfloat16: 3}
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


def align(n: int) -> int:
    """``n`` rounded up to the record alignment (8 bytes)."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


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


class ExperienceSpec:
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
            fields = [FieldSpec(n, tuple(s), d, allow_nonfinite) for n, (s, d) in fields.items()]
        fields = list(fields)
        if not fields:
            raise SpecError("an ExperienceSpec needs at least one field, got none")
        names = [f.name for f in fields]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise SpecError(f"field names must be unique, got duplicates {sorted(dup)}")
        self.fields: dict[str, FieldSpec] = {f.name: f for f in fields}
        order = sorted(fields, key=lambda f: -f.dtype.itemsize)
        self.offsets: dict[str, int] = {}
        off = 0
        for f in order:
            self.offsets[f.name] = off
            off = align(off + f.nbytes)
        self.record_bytes: int = max(off, ALIGN)
        # floating fields checked for NaN/inf, with the dtype their sum accumulates in
        self._checked = [
            (f.name, torch.float64 if f.dtype == torch.float64 else torch.float32)
            for f in fields
            if f.is_float and not f.allow_nonfinite
        ]
        # (name, start, end, dtype, shape) per field: the hot path does no dict lookups
        self._cols = [
            (f.name, self.offsets[f.name], self.offsets[f.name] + f.nbytes, f.dtype, f.shape)
            for f in fields
        ]
        self._dtypes = sorted({f.dtype for f in fields}, key=str)
        self._sizes = tuple(end - start for _, start, end, _, _ in self._cols)
        self._starts = tuple(start for _, start, _, _, _ in self._cols)
        checked = {name for name, _ in self._checked}
        self._kinds = tuple(_KIND[d] if n in checked else 0 for n, _, _, d, _ in self._cols)
        self._unchecked = (0,) * len(self._cols)
        # what pack checks per source, and whether the native table holds every field
        self._want = tuple((name, dtype, shape) for name, _, _, dtype, shape in self._cols)
        self._use_native = _native is not None and len(self._cols) <= _NATIVE_MAX_FIELDS

    trailer: int | None = None  # offset of the bytes a sampler writes after the fields

    def with_trailer(self, nbytes: int) -> ExperienceSpec:
        """This layout with ``nbytes`` (rounded up to 8) more per record after the fields, which
        ``pack`` leaves alone and ``unpack`` does not return: where a sampler writes what it
        delivers beside each item (see ``Sampler.trailer_bytes``). Equal to this spec."""
        out = copy.copy(self)
        out.trailer = self.record_bytes
        out.record_bytes = self.record_bytes + align(nbytes)
        return out

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

    def pack(
        self, batch: Mapping[str, torch.Tensor], out: torch.Tensor, *, check: bool = False
    ) -> None:
        """Copy a batch into records ``out`` (``uint8 [B, record_bytes]``).

        The batch and ``out`` are checked first (names, dtypes, shapes, ``B`` = the rows of
        ``out``; ``out`` is ``uint8``, 2-D, ``record_bytes`` wide with contiguous rows), since the
        copy itself runs on raw addresses. Values are not checked unless ``check`` is set.

        Args:
            batch: ``name -> tensor [B, *shape]`` matching the spec (any device).
            out: destination rows; may be a row slice of a larger record tensor.
            check: also reject NaN/inf in checked floating fields, in the same pass as the copy
                (as :meth:`check_finite`). On rejection ``out`` holds garbage: callers pack into
                rows they have not committed yet.

        Raises:
            SpecError: if ``batch`` does not match the spec or ``out`` (naming the field, the
                expected and the received value), or ``out`` is not ``uint8 [B, record_bytes]``
                with contiguous rows; with ``check``, naming the field and the number of
                non-finite values.

        Example:
            >>> spec = ExperienceSpec({"obs": ((4,), torch.float32)})
            >>> out = spec.empty_records(2)
            >>> spec.pack({"obs": torch.zeros(2, 4)}, out, check=True)
        """
        n = self._check_records("out", out)
        native = self._use_native and out.is_cpu
        srcs = self._sources(batch, n, native)
        if native:
            bad = _native.pack_rows(
                out.data_ptr(),
                self.record_bytes,
                n,
                tuple(t.data_ptr() for t in srcs),
                self._sizes,
                self._starts,
                self._kinds if check else self._unchecked,
            )
            if bad >= 0:
                self._reject(self._cols[bad][0], srcs[bad])
            return
        if check:
            self.check_finite(batch)
        for (_, start, end, dtype, shape), t in zip(self._cols, srcs):
            out[:, start:end].view(dtype).view(n, *shape).copy_(t)

    def _sources(
        self, batch: Mapping[str, torch.Tensor], n: int, native: bool
    ) -> list[torch.Tensor]:
        """The batch's tensors in field order, checked against the spec and ``n`` rows; for the
        native copy, as contiguous CPU tensors (the hot path: one dtype and shape test each)."""
        srcs, err = [], None
        try:
            for name, dtype, shape in self._want:
                t = batch[name]
                if t.dtype is not dtype or t.shape != (n, *shape):
                    break
                if native:
                    t = (t if t.is_cpu else t.cpu()).contiguous()
                srcs.append(t)
            else:
                return srcs
        except (KeyError, TypeError, AttributeError) as e:  # a missing field, not a tensor
            err = e
        got = self.validate(batch)  # names the field, the expected and the received value
        if got != n:
            raise SpecError(f"batch: expected {n} items (the rows of out), got {got}") from err
        raise SpecError(f"batch: does not match {self!r}") from err

    def _check_records(self, what: str, records: torch.Tensor) -> int:
        """Check that ``records`` is ``uint8 [n, record_bytes]`` with contiguous rows; returns
        ``n``. Raises SpecError naming ``what``, the expected and the received layout."""
        if (
            isinstance(records, torch.Tensor)
            and records.dtype is torch.uint8
            and records.dim() == 2
            and records.shape[1] == self.record_bytes
        ):
            n = records.shape[0]
            row, col = records.stride()
            if col == 1 and (row == self.record_bytes or n <= 1):
                return n
            raise SpecError(
                f"{what}: expected contiguous records, strides ({self.record_bytes}, 1), "
                f"got strides {records.stride()}"
            )
        if isinstance(records, torch.Tensor):
            got = f"a {records.dim()}-D {records.dtype} tensor {list(records.shape)}"
        else:
            got = type(records).__name__
        raise SpecError(
            f"{what}: expected a 2-D torch.uint8 torch.Tensor [n, record_bytes="
            f"{self.record_bytes}], got {got}"
        )

    def check_finite(self, batch: Mapping[str, torch.Tensor]) -> None:
        """Raise if a checked floating field of a validated ``batch`` holds NaN or inf.

        One sum per field and a single host sync: NaN/inf in any field makes the total non-finite.
        Only then (or when a sum of finite values overflowed) is each field checked exactly, to
        name the offender.

        Raises:
            SpecError: naming the field and the number of non-finite values.
        """
        if not self._checked:
            return
        if _native is not None:  # one tensor per call: no field table to outgrow
            for name, _ in self._checked:
                t = batch[name]
                if t.is_cpu:
                    t = t.contiguous()
                    bad = _native.any_nonfinite(t.data_ptr(), t.numel(), _KIND[t.dtype])
                else:
                    bad = not bool(torch.isfinite(t).all())
                if bad:
                    self._reject(name, t)
            return
        total = None
        for name, acc in self._checked:
            s = batch[name].sum(dtype=acc)
            total = s if total is None else total + s
        if math.isfinite(float(total)):
            return
        for name, _ in self._checked:
            if not bool(torch.isfinite(batch[name]).all()):
                self._reject(name, batch[name])

    def check_records_finite(self, records: torch.Tensor) -> None:
        """Raise if a checked floating field of ``records`` (``uint8 [B, record_bytes]``) holds
        NaN or inf, scanning the rows in place.

        Args:
            records: ``uint8 [B, record_bytes]`` with contiguous rows (any alignment on CPU).

        Raises:
            SpecError: if ``records`` is not such a tensor; naming the field and the number of
                non-finite values.
        """
        n = self._check_records("records", records)
        if not self._checked or n == 0:
            return
        if self._use_native and records.is_cpu:
            bad = _native.rows_nonfinite(
                records.data_ptr(),
                self.record_bytes,
                n,
                self._sizes,
                self._starts,
                self._kinds,
            )
            if bad >= 0:
                name, start, end, dtype, _ = self._cols[bad]
                # a copy: the rows need not be aligned for a view as the field's dtype
                self._reject(name, records[:, start:end].clone().view(dtype))
            return
        self.check_finite(self.unpack(records))

    @staticmethod
    def _reject(name: str, t: torch.Tensor) -> None:
        bad = int((~torch.isfinite(t)).sum())
        raise SpecError(
            f"field {name!r}: expected finite values, got {bad} NaN/inf "
            "(pass allow_nonfinite=True in the spec to accept them)"
        )

    def unpack(self, records: torch.Tensor) -> dict[str, torch.Tensor]:
        """View records as a dict of field tensors (no copy; rows keep the record stride).

        Args:
            records: ``uint8 [B, record_bytes]`` with contiguous rows.

        Returns:
            ``name -> tensor [B, *shape]`` views into ``records``.
        """
        n = records.shape[0]
        wide = {dtype: records.view(dtype) for dtype in self._dtypes}
        out = {}
        for name, start, end, dtype, shape in self._cols:
            size = dtype.itemsize
            if shape == ():
                out[name] = wide[dtype][:, start // size]
            elif len(shape) == 1:
                out[name] = wide[dtype][:, start // size : end // size]
            else:
                out[name] = wide[dtype][:, start // size : end // size].view(n, *shape)
        return out

    def empty_records(self, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Allocate ``n`` uninitialised records."""
        return torch.empty((n, self.record_bytes), dtype=torch.uint8, device=device)

    def state_dict(self) -> dict[str, object]:
        """A plain description (names, shapes, dtype names) usable without pickle."""
        return {
            n: {"shape": list(f.shape), "dtype": str(f.dtype), "allow_nonfinite": f.allow_nonfinite}
            for n, f in self.fields.items()
        }
