"""The fixed-size record layout of a spec's fields, and the byte copies in and out of it.

Every item of experience is stored as one *record*: a row of ``record_bytes`` bytes in which each
field sits at an offset aligned to 8 bytes. Storage, the wire format and delivery buffers are all
``[n, record_bytes]`` ``uint8`` tensors, so ingestion and delivery are plain byte copies, and a
received batch is viewed field by field with ``Tensor.view(dtype)`` on aligned column slices.

:class:`RecordLayout` computes the offsets and packs, unpacks and scans records (through the C
extension where it is built); :class:`~conduit_dist.records.spec.ExperienceSpec` subclasses it
with the fields' definition and the batch validation.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

from conduit_dist.errors import SpecError
from conduit_dist.records.native import KIND, NATIVE_MAX_FIELDS, _native

if TYPE_CHECKING:
    from conduit_dist.records.spec import FieldSpec

ALIGN = 8  # bytes: field offsets and record sizes are multiples of it
_Layout = TypeVar("_Layout", bound="RecordLayout")


def align(n: int) -> int:
    """``n`` rounded up to the record alignment (8 bytes)."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def nonfinite(tensors: Sequence[torch.Tensor], accumulate: Sequence[torch.dtype]) -> list[int]:
    """The indices of ``tensors`` that hold NaN or inf, with one host read per device.

    Each tensor is summed on its own device (in its ``accumulate`` dtype); the sums of one
    device are stacked and read to the host at once (one ``tolist``: on CUDA, one sync for all
    the fields). NaN or inf anywhere makes a sum non-finite; a non-finite sum of finite values
    (an overflow) is told apart by an exact check of that tensor alone, which only then costs
    another read.

    Args:
        tensors: floating tensors, on any devices.
        accumulate: the dtype each tensor's sum accumulates in (``float32`` or ``float64``).

    Returns:
        The indices, ascending (empty: every value is finite).

    Example:
        >>> nonfinite([torch.zeros(3), torch.tensor([1.0, float("nan")])], [torch.float32] * 2)
        [1]
    """
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    bad = []
    for idx in by_device.values():
        sums = torch.stack([tensors[i].sum(dtype=accumulate[i]).double() for i in idx])
        finite = torch.isfinite(sums).tolist()  # the one host read of this device
        for i, ok in zip(idx, finite, strict=True):
            if not ok and not bool(torch.isfinite(tensors[i]).all()):  # not just an overflow
                bad.append(i)
    return sorted(bad)


class RecordLayout:
    """Where each field sits in a record, and packing, unpacking and scanning records.

    Fields are laid out by descending element size, each at an 8-byte aligned offset. A base
    class: the subclass (:class:`~conduit_dist.records.spec.ExperienceSpec`) provides
    :meth:`validate`, which names the field of a batch that does not match.

    Args:
        fields: the fields, in the order the spec lists them.
    """

    def __init__(self, fields: list[FieldSpec]) -> None:
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
        self._kinds = tuple(KIND[d] if n in checked else 0 for n, _, _, d, _ in self._cols)
        self._unchecked = (0,) * len(self._cols)
        # what pack checks per source, and whether the native table holds every field
        self._want = tuple((name, dtype, shape) for name, _, _, dtype, shape in self._cols)
        self._use_native = _native is not None and len(self._cols) <= NATIVE_MAX_FIELDS

    trailer: int | None = None  # offset of the bytes a sampler writes after the fields

    def with_trailer(self: _Layout, nbytes: int) -> _Layout:
        """This layout with ``nbytes`` (rounded up to 8) more per record after the fields, which
        ``pack`` leaves alone and ``unpack`` does not return: where a sampler writes what it
        delivers beside each item (a ``WritesRows`` sampler's trailer). Equal to this spec."""
        out = copy.copy(self)
        out.trailer = self.record_bytes
        out.record_bytes = self.record_bytes + align(nbytes)
        return out

    def validate(self, batch: Mapping[str, torch.Tensor]) -> int:
        """Check a batch against the fields and return its size (the subclass's; see
        :meth:`ExperienceSpec.validate <conduit_dist.records.spec.ExperienceSpec.validate>`)."""
        raise NotImplementedError

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
                torch.get_num_threads(),  # large packs split as torch's copies are
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

        CPU fields are scanned in place by the C extension (no torch op, no copy). Every other
        field (CUDA, or CPU without the extension) goes through :func:`nonfinite`: one sum per
        field queued on its device and **one host read for all of them**, so a put from the GPU
        costs one host sync whatever its number of float fields. One sync per put is the floor:
        a rejected put must store nothing, so the verdict has to be on the host before any row
        is committed, and a check deferred to the round could no longer refuse the put.

        Raises:
            SpecError: naming the field and the number of non-finite values.
        """
        if not self._checked:
            return
        names, tensors, accs = [], [], []
        threads = torch.get_num_threads()  # large scans split as torch's copies are
        for name, acc in self._checked:
            t = batch[name]
            if t.is_cpu and _native is not None:
                t = t.contiguous()
                if _native.any_nonfinite(t.data_ptr(), t.numel(), KIND[t.dtype], threads):
                    self._reject(name, t)
            else:
                names.append(name)
                tensors.append(t)
                accs.append(acc)
        if tensors:
            bad = nonfinite(tensors, accs)
            if bad:
                self._reject(names[bad[0]], tensors[bad[0]])

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
