"""Token experience: ragged per-token fields beside fixed per-sequence ones, and the check that
turns a ``put`` batch into packed columns.

A :class:`TokenSpec` names the per-token fields (``tokens: int32[L]``, ``logprobs: float32[L]``,
...; every ragged field of one sequence has the same length ``L <= max_len``) and the fixed
per-sequence fields (``reward: float32``, the group field, ...). A batch of ``B`` sequences
arrives either packed (each ragged field ``[sum(L), *inner]`` and ``lengths=[B]``) or as
torch's jagged nested tensors (``torch.nested.nested_tensor(..., layout=torch.jagged)``); it is
checked whole before anything is stored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from conduit_dist.errors import SpecError
from conduit_dist.records.spec import SUPPORTED, FieldSpec
from conduit_dist.syncs import SYNCS
from conduit_dist.tiers.cuda import upload

TOKEN_VERSION = "_token_version"  # optional per-token policy versions (put(..., token_versions=))
_SHOWN = 3  # positions a NaN/inf error lists


@dataclass(frozen=True)
class Ragged:
    """A per-token field: ``L`` values of ``inner`` shape per sequence, ``1 <= L <= max_len``.

    Args:
        dtype: element dtype (one of the plane's supported dtypes).
        max_len: the longest sequence accepted (tokens).
        inner: per-token shape, ``()`` for one value per token.
        allow_nonfinite: accept NaN/inf in a floating field (rejected by default).
    """

    dtype: torch.dtype
    max_len: int
    inner: tuple[int, ...] = ()
    allow_nonfinite: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED:
            raise SpecError(
                f"Ragged.dtype: expected one of {[str(d) for d in SUPPORTED]}, got {self.dtype}"
            )
        if isinstance(self.max_len, bool) or not isinstance(self.max_len, int) or self.max_len < 1:
            raise SpecError(f"Ragged.max_len: expected an int >= 1, got {self.max_len!r}")
        object.__setattr__(self, "inner", tuple(int(s) for s in self.inner))
        if any(s <= 0 for s in self.inner):
            raise SpecError(f"Ragged.inner: expected positive sizes, got {self.inner}")

    @property
    def token_bytes(self) -> int:
        """Bytes per token."""
        return math.prod(self.inner) * self.dtype.itemsize


class TokenSpec:
    """The fields of one sequence: ragged per-token fields and fixed per-sequence ones.

    Args:
        fields: ``name -> Ragged(...)`` or ``name -> (shape, dtype)`` (fixed).
        group: the name of the fixed int64 field that holds each sequence's prompt-group id
            (added when absent).
        group_size: sequences per group; a group is deliverable once all have arrived.

    Raises:
        SpecError: no ragged field, ragged fields with different ``max_len``, a reserved or
            duplicate name, a bad dtype or shape, or a group field that is not int64 scalar.

    Example:
        >>> spec = TokenSpec({"tokens": Ragged(torch.int32, 8192),
        ...                   "reward": ((), torch.float32)}, group_size=8)
    """

    def __init__(
        self,
        fields: Mapping[str, Ragged | tuple[tuple[int, ...], torch.dtype]],
        group: str = "group",
        group_size: int = 1,
    ) -> None:
        if not isinstance(fields, Mapping) or not fields:
            raise SpecError(f"fields: expected a non-empty mapping, got {fields!r}")
        self.ragged = {n: f for n, f in fields.items() if isinstance(f, Ragged)}
        if not self.ragged:
            raise SpecError(
                "fields: expected at least one Ragged field (use ExperienceSpec "
                "and DataPlane for fixed-size items), got none"
            )
        lens = {f.max_len for f in self.ragged.values()}
        if len(lens) != 1:
            raise SpecError(
                f"fields: every Ragged field of a sequence has the same length, so "
                f"the same max_len; got {sorted(lens)}"
            )
        self.max_len = lens.pop()
        fixed = [
            FieldSpec(n, tuple(s), d)
            for n, f in fields.items()
            if not isinstance(f, Ragged)
            for s, d in [f]
        ]
        for n in self.ragged:
            FieldSpec(n, (), self.ragged[n].dtype)  # the same name rules as fixed fields
        if group not in {f.name for f in fixed}:
            fixed.append(FieldSpec(group, (), torch.int64))
        self.fixed = {f.name: f for f in fixed}
        if self.fixed[group].shape != () or self.fixed[group].dtype != torch.int64:
            f = self.fixed[group]
            raise SpecError(
                f"group field {group!r}: expected int64 scalars, got {f.dtype} {list(f.shape)}"
            )
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise SpecError(f"group_size: expected an int >= 1, got {group_size!r}")
        self.group, self.group_size = group, group_size
        self.token_bytes = sum(f.token_bytes for f in self.ragged.values())

    def __repr__(self) -> str:
        r = ", ".join(
            f"{n}: {f.dtype}[L{''.join(f', {s}' for s in f.inner)}]" for n, f in self.ragged.items()
        )
        fx = ", ".join(f"{n}: {f.dtype}{list(f.shape)}" for n, f in self.fixed.items())
        return (
            f"TokenSpec({r}; {fx}; L <= {self.max_len}; group={self.group!r} x {self.group_size})"
        )

    def state_dict(self) -> dict[str, object]:
        """A plain description (names, dtypes, shapes) for checkpoints; no pickle."""
        return {
            "ragged": {n: [str(f.dtype), f.max_len, list(f.inner)] for n, f in self.ragged.items()},
            "fixed": {n: [str(f.dtype), list(f.shape)] for n, f in self.fixed.items()},
            "group": self.group,
            "group_size": self.group_size,
        }


@dataclass
class Packed:
    """A checked ``put`` batch: ``n`` sequences as packed columns (token and fixed columns where
    they were put; the group field, lengths and versions on the host)."""

    fixed: dict[str, torch.Tensor]  # name -> [n, *shape]
    ragged: dict[str, torch.Tensor]  # name -> [sum(lengths), *inner]
    lengths: torch.Tensor  # [n] int64
    versions: torch.Tensor  # [n] int64: each sequence's oldest token's policy version

    @property
    def n(self) -> int:
        """Sequences in the batch."""
        return int(self.lengths.shape[0])


def _unnest(name: str, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A jagged nested tensor's packed values and lengths."""
    if t.layout is not torch.jagged:
        raise SpecError(
            f"field {name!r}: expected a packed tensor or a jagged nested tensor "
            f"(layout=torch.jagged), got layout {t.layout}"
        )
    return t.values(), t.offsets().diff().to(torch.int64)


def _nonfinite(name: str, values: torch.Tensor, lengths: torch.Tensor | None) -> SpecError:
    """The error for NaN/inf in a field: how many values, and where the first ones are.

    Args:
        name: the field.
        values: a ragged field's packed ``[sum(L), *inner]`` (with ``lengths``) or a fixed
            field's ``[B, *shape]`` (``lengths`` ``None``).
        lengths: ``[B]`` int64 sequence lengths on the host, for a ragged field.

    Returns:
        A :class:`SpecError` naming the count and the first positions: (sequence, token offset)
        for a ragged field, the sequence for a fixed one.
    """
    bad = ~torch.isfinite(values.detach())
    in_row = bad.reshape(bad.shape[0], -1).any(dim=1)  # tokens (ragged) or sequences (fixed)
    rows = in_row.nonzero().flatten()[:_SHOWN].cpu()
    count, hit = int(bad.sum()), int(in_row.sum())
    if lengths is None:
        where = ", ".join(f"sequence {r}" for r in rows.tolist())
        what = f"{count} NaN/inf in {hit} of {values.shape[0]} sequences"
        accept = ""
    else:
        ends = lengths.cumsum(0)
        seq = torch.searchsorted(ends, rows, right=True)
        offset = rows - (ends - lengths)[seq]
        where = ", ".join(
            f"sequence {s} token {t}" for s, t in zip(seq.tolist(), offset.tolist(), strict=True)
        )
        what = f"{count} NaN/inf in {hit} of {values.shape[0]} tokens"
        accept = " (Ragged(..., allow_nonfinite=True) accepts them)"
    more = ", ..." if hit > len(rows) else ""
    return SpecError(
        f"field {name!r}: expected finite values, got {what}, first at {where}{more}{accept}"
    )


def _check_ragged(spec: TokenSpec, name: str, values: torch.Tensor, total: int) -> None:
    f = spec.ragged[name]
    if values.dtype != f.dtype:
        raise SpecError(f"field {name!r}: expected dtype {f.dtype}, got {values.dtype}")
    if tuple(values.shape) != (total, *f.inner):
        raise SpecError(
            f"field {name!r}: expected packed shape {[total, *f.inner]} "
            f"(sum of lengths = {total}), got {list(values.shape)}"
        )


def _on_host(t: torch.Tensor, reason: str) -> torch.Tensor:
    """``t`` on the host: a CUDA tensor's copy is a host sync, counted as ``reason``."""
    if t.is_cuda:
        SYNCS.add(reason)
    return t.to("cpu")


def check_batch(
    spec: TokenSpec,
    batch: Mapping[str, torch.Tensor],
    lengths: torch.Tensor | None,
    version: int,
    token_versions: torch.Tensor | None = None,
) -> Packed:
    """Check a whole ``put`` batch against ``spec``: what the store's bookkeeping reads comes to
    the host, the token and fixed columns stay where they were put.

    Put from CUDA tensors, at most two reads of the device (each counted in
    :data:`~conduit_dist.syncs.SYNCS`): the lengths, when they are a CUDA tensor; then one
    for everything checked or read on the host together (each float field's finiteness, the
    group ids, each sequence's oldest token version).

    Args:
        spec: the plane's token spec.
        batch: ``name -> tensor``: ragged fields packed (``[sum(L), *inner]``, with
            ``lengths``) or jagged nested tensors; fixed fields ``[B, *shape]``.
        lengths: ``[B]`` sequence lengths (``None`` with nested tensors).
        version: the producer's policy version, used where ``token_versions`` is not given.
        token_versions: optional ``[sum(L)]`` int64 per-token versions (a response whose
            generation spanned a weight update); a sequence's version is its oldest token's.

    Returns:
        The :class:`Packed` batch: the caller's tensors (detached; the store copies them into
        its columns before ``put`` returns), the group field, lengths and versions on the host.

    Raises:
        SpecError: naming the field, the expected and the received value; nothing is stored.
    """
    if not isinstance(batch, Mapping) or batch.keys() != spec.ragged.keys() | spec.fixed.keys():
        got = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise SpecError(
            f"batch: expected fields {sorted(spec.ragged.keys() | spec.fixed.keys())}, got {got}"
        )
    ragged, nested = {}, None
    for name in spec.ragged:
        t = batch[name]
        if not isinstance(t, torch.Tensor):
            raise SpecError(f"field {name!r}: expected a torch.Tensor, got {type(t).__name__}")
        if t.is_nested:
            t, lens = _unnest(name, t)
            lens = _on_host(lens, "token put lengths")
            if lengths is not None and not torch.equal(
                _on_host(torch.as_tensor(lengths).reshape(-1), "token put lengths").long(), lens
            ):
                raise SpecError(
                    f"field {name!r}: its sequence lengths {lens.tolist()[:8]} differ "
                    "from those of the other ragged fields / lengths "
                    f"{torch.as_tensor(lengths).reshape(-1).tolist()[:8]}"
                )
            lengths = nested = lens
        ragged[name] = t.detach()
    if lengths is None:
        raise SpecError(
            "lengths: expected a [B] int tensor of sequence lengths with packed "
            "ragged fields, got None"
        )
    if lengths is not nested:
        lengths = _on_host(torch.as_tensor(lengths).reshape(-1), "token put lengths")
    lengths = lengths.to(torch.int64)
    n = lengths.shape[0]
    if n == 0:
        raise SpecError("batch is empty: expected at least one sequence, got 0")
    lo, hi = int(lengths.min()), int(lengths.max())
    if lo < 1 or hi > spec.max_len:
        raise SpecError(
            f"lengths: expected every length in [1, {spec.max_len}] (max_len), got "
            f"min {lo}, max {hi}"
        )
    total = int(lengths.sum())
    for name, values in ragged.items():
        _check_ragged(spec, name, values, total)
    fixed = {}
    for name, f in spec.fixed.items():
        t = batch[name]
        if not isinstance(t, torch.Tensor) or t.dtype != f.dtype or tuple(t.shape) != (n, *f.shape):
            got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise SpecError(f"field {name!r}: expected {f.dtype} {[n, *f.shape]}, got {got}")
        fixed[name] = t.detach()
    tv = token_versions
    if tv is not None and (
        not isinstance(tv, torch.Tensor) or tv.dtype != torch.int64 or tuple(tv.shape) != (total,)
    ):
        got = f"{tv.dtype} {list(tv.shape)}" if isinstance(tv, torch.Tensor) else type(tv).__name__
        raise SpecError(f"token_versions: expected int64 [{total}] (one per token), got {got}")
    return _read(spec, ragged, fixed, lengths, tv, version)


def _read(spec: TokenSpec, ragged, fixed, lengths: torch.Tensor, tv, version: int) -> Packed:
    """The shape-checked batch's host reads (see :func:`check_batch`), then the finiteness
    errors (in field order) and the :class:`Packed` batch."""
    checked = [
        (name, v, lengths)
        for name, v in ragged.items()
        if v.is_floating_point() and not spec.ragged[name].allow_nonfinite and v.numel()
    ] + [(name, v, None) for name, v in fixed.items() if v.is_floating_point()]
    n = lengths.shape[0]
    g = spec.group
    on_device = [torch.isfinite(v).all().reshape(1).long() for _, v, _ in checked if v.is_cuda]
    if fixed[g].is_cuda:
        on_device.append(fixed[g].reshape(-1).long())
    if tv is not None and tv.is_cuda:
        on_device.append(_oldest(tv, lengths))
    host = iter(_on_host(torch.cat(on_device), "token put checks").tolist() if on_device else [])
    for name, v, lens in checked:
        finite = next(host) if v.is_cuda else bool(torch.isfinite(v).all())
        if not finite:
            raise _nonfinite(name, v, lens)
    if fixed[g].is_cuda:
        fixed[g] = torch.tensor([next(host) for _ in range(n)], dtype=fixed[g].dtype)
    if tv is None:
        versions = torch.full((n,), int(version), dtype=torch.int64)
    elif tv.is_cuda:
        versions = torch.tensor([next(host) for _ in range(n)], dtype=torch.int64)
    else:
        versions = _oldest(tv, lengths)
    return Packed(fixed, ragged, lengths, versions)


def _oldest(tv: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Each sequence's oldest token version (``tv``: ``[sum(lengths)]``, on its device)."""
    n = lengths.shape[0]
    seq = upload(torch.repeat_interleave(torch.arange(n), lengths), tv.device)
    out = torch.full((n,), torch.iinfo(torch.int64).max, dtype=torch.int64, device=tv.device)
    return out.scatter_reduce_(0, seq, tv, reduce="amin")
