"""The self-describing weights buffer: its layout, packing a module's state into it (whole or a
part), and reading and checking a received one (``flow/weights.py`` moves and loads them).

A buffer carries its own layout, so a receiver checks names, shapes and dtypes against its
module before it loads a byte (no pickle)::

    preamble  12 bytes, little-endian: magic b"CDWT", format (uint32, 1), header length H (uint32)
    header    H bytes of UTF-8 JSON: {"payload_bytes": P, "tensors": [
                  {"name": "0.weight", "dtype": "float32", "shape": [4, 3], "offset": 0}, ...]}
    padding   zeros up to the next multiple of 8
    payload   P bytes: each tensor's values, C order, at its offset (a multiple of 8)
"""

from __future__ import annotations

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
class Layout:
    """The tensors of a buffer by name, and where its payload starts."""

    entries: dict[str, Entry]
    start: int


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
        if hasattr(t, "placements") and hasattr(t, "to_local"):  # a DTensor (FSDP2, TP)
            raise SpecError(
                f"weights: state {name!r} is a DTensor sharded as {tuple(t.placements)}: "
                "sending each learner's shard is not supported yet (docs/weights.md); publish "
                "an unsharded module, e.g. one loaded from torch.distributed.checkpoint."
                "state_dict.get_model_state_dict(model, options=StateDictOptions("
                "full_state_dict=True))"
            )
    return state


def entries_of(state: dict[str, torch.Tensor]) -> dict[str, Entry]:
    """The layout ``state`` packs to: each tensor at the next 8-byte aligned offset."""
    out, off = {}, 0
    for name, t in state.items():
        out[name] = Entry(name, t.dtype, tuple(t.shape), off)
        off = align(off + out[name].nbytes)
    return out


def header_of(entries: dict[str, Entry]) -> tuple[bytes, int]:
    """The preamble and JSON header of a buffer of ``entries``, and the payload's start."""
    payload = max((align(e.offset + e.nbytes) for e in entries.values()), default=0)
    tensors = [
        {"name": n, "dtype": dtype_name(e.dtype), "shape": list(e.shape), "offset": e.offset}
        for n, e in entries.items()
    ]
    header = json.dumps({"payload_bytes": payload, "tensors": tensors}).encode()
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
    return Layout(entries, start)


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
