"""The self-describing weights buffer: its layout, packing a module's state into it (whole or a
part), and reading and checking a received one (``flow/weights.py`` moves and loads them).

A buffer carries its own layout, so a receiver checks names, shapes and dtypes against its
module before it loads a byte (no pickle)::

    preamble  12 bytes, little-endian: magic b"CDWT", format (uint32, 1), header length H (uint32)
    header    H bytes of UTF-8 JSON: {"payload_bytes": P, "tensors": [
                  {"name": "0.weight", "dtype": "float32", "shape": [4, 3], "offset": 0}, ...]}
    padding   zeros up to the next multiple of 8
    payload   P bytes: each tensor's values, C order, at its offset (a multiple of 8)

A sharded state (FSDP2 ``fully_shard``: DTensors ``Shard(0)`` on a 1-D mesh) keeps that layout,
the unsharded tensors' (global shapes), and its header adds ``"shards": {"holders": [global
ranks, mesh order], "ranges": [[[lo, hi], ...] per holder]}``: the payload bytes each holder
packs (its rows of each sharded tensor, as ``torch.chunk`` splits them, and a share of the
unsharded ones), so each learner sends only what it holds and a receiver knows who sends what
from the header alone.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import struct
from dataclasses import dataclass

import torch
from torch import nn

from conduit_dist.errors import SpecError
from conduit_dist.records.spec import ALIGN, SUPPORTED, align

MAGIC = b"CDWT"
FORMAT = 1
PREAMBLE = struct.Struct("<4sII")  # magic, format, header length
KEYS = ("dtype", "name", "offset", "shape")
DTYPES = {  # the names the JSON header uses: the record dtypes, and complex for weights
    str(d).removeprefix("torch."): d for d in (*SUPPORTED, torch.complex64, torch.complex128)
}


def dtype_name(dtype: torch.dtype) -> str:
    """The name a header gives ``dtype`` (``torch.float32`` -> ``"float32"``)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Entry:
    """One tensor of a weights buffer: where its values sit in the payload."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def describe(self) -> str:
        return f"{list(self.shape)} {self.dtype}"


@dataclass(frozen=True)
class Shards:
    """Who packs which payload bytes of a sharded state's buffer.

    Attributes:
        holders: the global ranks holding the shards, in mesh order.
        ranges: per holder, the ``[lo, hi)`` payload byte ranges it packs (together, the
            whole payload, each byte once).
    """

    holders: tuple[int, ...]
    ranges: tuple[tuple[tuple[int, int], ...], ...]


@dataclass(frozen=True)
class Layout:
    """The tensors of a buffer by name, where its payload starts, and its shards (``None``:
    one packer wrote it whole, or any split of it)."""

    entries: dict[str, Entry]
    start: int
    shards: Shards | None = None


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor (FSDP2, tensor parallel): a sharded tensor's local part."""
    return hasattr(t, "placements") and hasattr(t, "to_local")


def _sharded_rows(name: str, t) -> bool:
    """Whether DTensor ``t`` is sharded along rows (``Shard(0)``; ``False``: replicated);
    anything else, or a mesh of more than one dimension, is refused by name."""
    placements = tuple(t.placements)
    if t.device_mesh.ndim != 1 or len(placements) != 1:
        raise SpecError(
            f"weights: state {name!r} is a DTensor on a {t.device_mesh.ndim}-D mesh placed as "
            f"{placements}: expected a 1-D mesh (FSDP2 fully_shard) with Shard(0) or "
            "Replicate(); publish a full state_dict for other layouts (docs/weights.md)"
        )
    p = placements[0]
    if p.is_replicate():
        return False
    if p.is_shard() and getattr(p, "dim", None) == 0:
        return True
    raise SpecError(
        f"weights: state {name!r} is a DTensor placed as {placements}: expected Shard(0) "
        "(FSDP2 fully_shard) or Replicate(); publish a full state_dict for other layouts"
    )


def checked_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state_dict, checked: tensors of a supported dtype only."""
    state = module.state_dict()
    if not state:
        raise SpecError("weights: expected a module with parameters or buffers, got none")
    for name, t in state.items():
        if not isinstance(t, torch.Tensor) or dtype_name(t.dtype) not in DTYPES:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise SpecError(
                f"weights: state {name!r}: expected a tensor of dtype {sorted(DTYPES)}, got {got}"
            )
        if is_dtensor(t):  # FSDP2: sent shard by shard (Shards), checked here
            _sharded_rows(name, t)
    return state


def shards_of(state: dict[str, torch.Tensor], entries: dict[str, Entry]) -> Shards | None:
    """Which payload bytes each holder of a sharded ``state`` packs (``None``: no DTensor in
    it): its rows of every ``Shard(0)`` tensor, split as ``torch.chunk`` splits them (FSDP2's
    split; alignment padding goes with the last rows), and each unsharded or replicated tensor
    whole to the holder with the fewest bytes so far.

    Raises:
        SpecError: if the DTensors lie on different meshes.
    """
    holders: tuple[int, ...] | None = None
    for name, t in state.items():
        if is_dtensor(t):
            ranks = tuple(t.device_mesh.mesh.reshape(-1).tolist())
            if holders is not None and ranks != holders:
                raise SpecError(
                    f"weights: state {name!r} is sharded over ranks {list(ranks)}, an earlier "
                    f"tensor over {list(holders)}: expected one mesh for the whole state"
                )
            holders = ranks
    if holders is None:
        return None
    count = len(holders)
    load = [0] * count
    got: list[list[tuple[int, int]]] = [[] for _ in holders]
    for name, t in state.items():
        e = entries[name]
        at, end = e.offset, align(e.offset + e.nbytes)
        if at == end:
            continue
        if is_dtensor(t) and _sharded_rows(name, t):
            n = e.shape[0]
            row = e.nbytes // n
            for c in range(count):
                r0, r1 = _chunk_rows(n, count, c)
                if r0 < r1:
                    got[c].append((at + r0 * row, end if r1 == n else at + r1 * row))
                    load[c] += (r1 - r0) * row
        else:
            c = min(range(count), key=lambda i: (load[i], i))
            got[c].append((at, end))
            load[c] += end - at
    return Shards(holders, tuple(tuple(_merged(rs)) for rs in got))


def _chunk_rows(n: int, count: int, c: int) -> tuple[int, int]:
    """Rows ``[r0, r1)`` of ``n`` that ``torch.chunk`` gives part ``c`` of ``count`` (FSDP2's
    ``Shard(0)`` split: parts of ``ceil(n / count)`` rows, the last ones short or empty)."""
    chunk = -(-n // count)
    return min(c * chunk, n), min((c + 1) * chunk, n)


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` sorted, adjacent ones joined."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def local_rows(name: str, t, e: Entry) -> tuple[torch.Tensor, int]:
    """A state tensor's local values and the first row they hold: a ``Shard(0)`` DTensor's
    rows (where ``torch.chunk`` puts this rank's), or a whole tensor (row 0).

    Raises:
        SpecError: if a shard holds other rows than ``torch.chunk`` gives its mesh coordinate.
    """
    if not is_dtensor(t):
        return t.detach(), 0
    local = t.to_local().detach()
    if not _sharded_rows(name, t):
        return local, 0
    n, count = e.shape[0], t.device_mesh.size()
    c = t.device_mesh.get_coordinate()[0]
    r0, r1 = _chunk_rows(n, count, c)
    if tuple(local.shape) != (r1 - r0, *e.shape[1:]):
        raise SpecError(
            f"weights: state {name!r}: mesh coordinate {c} of {count} holds a shard of shape "
            f"{list(local.shape)}, expected rows [{r0}, {r1}) of {list(e.shape)} (torch.chunk's "
            "split, as FSDP2 shards)"
        )
    return local, r0


def entries_of(state: dict[str, torch.Tensor]) -> dict[str, Entry]:
    """The layout ``state`` packs to: each tensor at the next 8-byte aligned offset."""
    out, off = {}, 0
    for name, t in state.items():
        out[name] = Entry(name, t.dtype, tuple(t.shape), off)
        off = align(off + out[name].nbytes)
    return out


def header_of(entries: dict[str, Entry], shards: Shards | None = None) -> tuple[bytes, int]:
    """The preamble and JSON header of a buffer of ``entries`` (and ``shards``: who packs
    what), and the buffer's whole size."""
    payload = max((align(e.offset + e.nbytes) for e in entries.values()), default=0)
    tensors = [
        {"name": n, "dtype": dtype_name(e.dtype), "shape": list(e.shape), "offset": e.offset}
        for n, e in entries.items()
    ]
    desc: dict[str, object] = {"payload_bytes": payload, "tensors": tensors}
    if shards is not None:
        ranges = [[list(r) for r in rs] for rs in shards.ranges]
        desc["shards"] = {"holders": list(shards.holders), "ranges": ranges}
    header = json.dumps(desc).encode()
    head = PREAMBLE.pack(MAGIC, FORMAT, len(header)) + header
    return head, align(len(head)) + payload


def fill(
    buf: torch.Tensor, head: bytes, entries: dict[str, Entry], state, lo: int = 0, hi: int = -1
) -> None:
    """Write bytes ``[lo, hi)`` of the buffer of ``state`` into ``buf`` (``hi=-1``: to the end):
    the header ``head`` (padded with zeros) and the tensors' values, each copied where it is
    (the header goes up from the host). A part (a learner's share of a buffer several send)
    writes only its bytes: a tensor that straddles a part's edge is copied byte range by byte
    range, as raw bytes."""
    hi = buf.numel() if hi < 0 else hi
    start = align(len(head))
    if lo < start:  # the preamble, header and its padding
        raw = torch.frombuffer(bytearray(head.ljust(start, b"\0")), dtype=torch.uint8)
        buf[lo : min(hi, start)].copy_(raw[lo : min(hi, start)])
    for name, t in state.items():
        e = entries[name]
        at = start + e.offset
        end = align(at + e.nbytes)
        a, b = max(lo, at), min(hi, end)
        if a >= b:
            continue
        if a == at and b >= at + e.nbytes:  # the whole tensor, in its own dtype
            buf[at : at + e.nbytes].view(e.dtype).copy_(t.detach().reshape(-1))
        elif a < at + e.nbytes:  # a byte range of it
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
            buf[a : min(b, at + e.nbytes)].copy_(raw[a - at : min(b, at + e.nbytes) - at])
        if b > at + e.nbytes:  # alignment padding: zeros, as a fresh buffer's
            buf[max(a, at + e.nbytes) : b].zero_()


def fill_shards(buf: torch.Tensor, head: bytes, entries: dict[str, Entry], state, mine) -> None:
    """Write the header and this holder's payload ranges ``mine`` (:class:`Shards`, sorted) of
    a sharded ``state``'s buffer: each tensor's local rows at their global offset, as raw bytes,
    and its alignment padding as zeros."""
    start = align(len(head))
    fill(buf, head, {}, {}, 0, start)  # the header and its padding
    spans = [(start + a, start + b) for a, b in mine]
    starts = [a for a, _ in spans]
    for name, t in state.items():
        e = entries[name]
        at, end = start + e.offset, start + align(e.offset + e.nbytes)
        k = max(0, bisect.bisect_right(starts, at) - 1)  # the first span that may hold it
        for a, b in spans[k:]:  # the parts of this tensor's bytes that are this holder's
            if a >= end:
                break
            a, b = max(a, at), min(b, end)
            if a >= b:
                continue
            local, r0 = local_rows(name, t, e)
            raw = local.contiguous().reshape(-1).view(torch.uint8)
            first = at + r0 * (e.nbytes // e.shape[0] if r0 else 0)  # where ``raw`` goes
            last = first + raw.numel()
            if a < last:
                buf[a : min(b, last)].copy_(raw[a - first : min(b, last) - first])
            if b > last:  # alignment padding
                buf[max(a, last) : b].zero_()


def pack_part(pending: tuple, a: int, b: int) -> None:
    """Pack bytes ``[a, b)`` of a lazy publish ``pending`` (clipped to its part)."""
    buf, head, entries, state, lo, hi = pending
    fill(buf, head, entries, state, max(a, lo), min(b, hi))


def buffer_bytes(module: nn.Module) -> int:
    """The size of ``module``'s weights buffer (header and payload) as published, packing
    nothing."""
    return header_of(entries_of(checked_state(module)))[1]


def _corrupt(what: str) -> SpecError:
    return SpecError(f"weights: corrupted header: {what}")


def _entry(i: int, d: object, payload: int) -> Entry:
    """Check one JSON tensor description against the payload size."""
    if not isinstance(d, dict) or sorted(d) != list(KEYS):
        got = sorted(d) if isinstance(d, dict) else type(d).__name__
        raise _corrupt(f"tensor {i}: expected keys {list(KEYS)}, got {got}")
    name, dtype, shape, off = d["name"], d["dtype"], d["shape"], d["offset"]
    if not isinstance(name, str):
        raise _corrupt(f"tensor {i}: expected a string name, got {name!r}")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise _corrupt(f"tensor {name!r}: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
        raise _corrupt(f"tensor {name!r}: shape must be a list of ints >= 0, got {shape!r}")
    if type(off) is not int or off < 0 or off % ALIGN:
        raise _corrupt(f"tensor {name!r}: offset must be an int multiple of {ALIGN}, got {off!r}")
    e = Entry(name, DTYPES[dtype], tuple(shape), off)
    if e.offset + e.nbytes > payload:
        raise _corrupt(
            f"tensor {name!r} lies outside the payload: bytes [{off}, {off + e.nbytes}) "
            f"of {payload}"
        )
    return e


def decode(buf: torch.Tensor | bytes, size: int | None = None) -> Layout:
    """Read and check the layout of a weights buffer (not the payload's values).

    Args:
        buf: a host buffer, or the first bytes of one (its preamble and header at least: a
            device buffer's header read to the host, a publisher's header).
        size: the whole buffer's size in bytes, with ``bytes`` (its payload is not read).
    """
    if isinstance(buf, torch.Tensor):
        size = buf.numel()
        host = buf

        def read(a: int, b: int) -> bytes:
            return host[a:b].numpy().tobytes()
    else:
        raw_all = bytes(buf)

        def read(a: int, b: int) -> bytes:
            return raw_all[a:b]

    if size < PREAMBLE.size:
        raise SpecError(
            f"weights: truncated buffer: expected at least the {PREAMBLE.size}-byte preamble, "
            f"got {size} bytes"
        )
    raw = read(0, PREAMBLE.size)
    magic, fmt, hlen = PREAMBLE.unpack(raw)
    if magic != MAGIC:
        raise SpecError(
            f"weights: not a conduit_dist weights buffer: expected magic {MAGIC!r}, got {magic!r}"
        )
    if fmt != FORMAT:
        raise SpecError(f"weights: expected buffer format {FORMAT}, got format {fmt}")
    if PREAMBLE.size + hlen > size:
        raise SpecError(
            f"weights: truncated buffer: the header needs bytes [{PREAMBLE.size}, "
            f"{PREAMBLE.size + hlen}), got {size} bytes"
        )
    try:
        header = json.loads(read(PREAMBLE.size, PREAMBLE.size + hlen))
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise _corrupt(f"expected UTF-8 JSON, got {e}") from e
    if not isinstance(header, dict) or not isinstance(header.get("tensors"), list):
        got = type(header.get("tensors") if isinstance(header, dict) else header).__name__
        raise _corrupt(f"expected an object with a list 'tensors', got {got}")
    payload, start = header.get("payload_bytes"), align(PREAMBLE.size + hlen)
    if type(payload) is not int or payload < 0:
        raise _corrupt(f"expected an int 'payload_bytes' >= 0, got {payload!r}")
    if start + payload != size:
        raise SpecError(
            f"weights: {'truncated ' if start + payload > size else ''}payload: the header "
            f"describes {payload} bytes from byte {start}, the buffer holds {size - start} bytes"
        )
    entries = {}
    for i, d in enumerate(header["tensors"]):
        e = _entry(i, d, payload)
        if e.name in entries:
            raise _corrupt(f"tensor {e.name!r} is listed twice")
        entries[e.name] = e
    shards = _shards(header["shards"], payload) if "shards" in header else None
    return Layout(entries, start, shards)


def _shards(d: object, payload: int) -> Shards:
    """Check a header's ``"shards"``: distinct holder ranks, each with ``[lo, hi)`` ranges,
    together covering the payload once."""
    if not isinstance(d, dict) or sorted(d) != ["holders", "ranges"]:
        raise _corrupt(f"shards: expected keys ['holders', 'ranges'], got {d!r:.200}")
    holders, ranges = d["holders"], d["ranges"]
    if (
        not isinstance(holders, list)
        or not holders
        or not all(type(h) is int and h >= 0 for h in holders)
        or len(set(holders)) != len(holders)
    ):
        raise _corrupt(f"shards: expected distinct ranks >= 0, got holders {holders!r:.200}")
    if not isinstance(ranges, list) or len(ranges) != len(holders):
        raise _corrupt(f"shards: expected one list of ranges per holder ({len(holders)})")
    got = []
    for rs in ranges:
        if not isinstance(rs, list) or not all(
            isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r) for r in rs
        ):
            raise _corrupt(f"shards: expected [[lo, hi], ...] per holder, got {rs!r:.200}")
        got.append(tuple((lo, hi) for lo, hi in rs))
    edge = 0
    for lo, hi in sorted(r for rs in got for r in rs):
        if lo != edge or hi <= lo:
            raise _corrupt(
                f"shards: the ranges must cover the {payload}-byte payload once, in pieces "
                f"[lo, hi) with lo < hi; got [{lo}, {hi}) after byte {edge}"
            )
        edge = hi
    if edge != payload:
        raise _corrupt(f"shards: the ranges cover {edge} of the {payload}-byte payload")
    return Shards(tuple(holders), tuple(got))


def differences(mine: dict[str, Entry], got: dict[str, Entry]) -> list[str]:
    """What differs between the module's layout and a buffer's, one phrase per difference."""
    out = [
        f"{n!r}: expected {e.describe()}, received {got[n].describe()}"
        for n, e in mine.items()
        if n in got and (e.shape, e.dtype) != (got[n].shape, got[n].dtype)
    ]
    missing = [n for n in mine if n not in got]
    extra = [n for n in got if n not in mine]
    if missing:
        out.append(f"missing from the published weights: {missing}")
    if extra:
        out.append(f"unexpected (not in the module): {extra}")
    return out


def head_digest(head: bytes) -> int:
    """A weights header's 63-bit digest (blake2b; carried in a round's meta as an int64), so a
    receiver of a device buffer reads the header only when it is new."""
    return int.from_bytes(hashlib.blake2b(head, digest_size=8).digest(), "little") >> 1
