"""The attach protocol's frames: a fixed prefix, a JSON header, then raw tensor bytes.

A frame is ``MAGIC`` (4 bytes), the header's length and the payload's length (little-endian
uint32 and uint64), the header (UTF-8 JSON: ``op`` and its fields, and ``tensors``: each
tensor's name, dtype, shape and byte count, in payload order), then the payload: the tensors'
bytes back to back. Nothing is pickled; a receiver checks every dtype against
:data:`DTYPES` and every size against the header before it builds a tensor.
"""

from __future__ import annotations

import json
import math
import socket
import struct
from collections.abc import Mapping

import torch

MAGIC = b"CDA1"
_PREFIX = struct.Struct("<4sIQ")
MAX_HEADER = 1 << 20  # bytes of JSON a frame may carry
DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
        torch.float16, torch.bfloat16, torch.float32, torch.float64,
    )
}  # fmt: skip


class FrameError(ConnectionError):
    """A peer sent something that is not a frame of this protocol (the connection is dropped)."""


def encode(header: Mapping[str, object], tensors: Mapping[str, torch.Tensor] | None = None):
    """A frame as a list of buffers to send in order (tensors are not copied into one).

    Args:
        header: the JSON-able fields (``op`` first by convention).
        tensors: host tensors (made contiguous here), in payload order.

    Raises:
        ValueError: on a dtype outside :data:`DTYPES`.
    """
    metas, parts = [], []
    for name, t in (tensors or {}).items():
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise ValueError(f"{name}: expected a dtype in {sorted(DTYPES)}, got {t.dtype}")
        nbytes = t.numel() * t.element_size()
        metas.append({"name": name, "dtype": dtype, "shape": list(t.shape), "nbytes": nbytes})
        if nbytes:
            parts.append(t.view(-1).view(torch.uint8).numpy().data)
    head = json.dumps({**header, "tensors": metas}).encode()
    payload = sum(m["nbytes"] for m in metas)
    return [_PREFIX.pack(MAGIC, len(head), payload), head, *parts]


def send(sock: socket.socket, frame: list) -> None:
    """Send an :func:`encode`-d frame (the caller serialises senders)."""
    for part in frame:
        sock.sendall(part)


def _read_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionResetError("the peer closed the connection")
        got += k
    return buf


def receive(sock: socket.socket) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read one frame: its header and its tensors (each over its own bytes).

    Raises:
        FrameError: on a bad prefix, header or tensor description.
        ConnectionError / OSError / TimeoutError: from the socket.
    """
    magic, hlen, plen = _PREFIX.unpack(_read_exact(sock, _PREFIX.size))
    if magic != MAGIC or hlen > MAX_HEADER:
        raise FrameError(f"expected a frame starting {MAGIC!r}, got {bytes(magic)!r}")
    try:
        header = json.loads(_read_exact(sock, hlen).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FrameError(f"a frame's header is not JSON ({exc})") from None
    metas = header.pop("tensors", [])
    total = 0
    for m in metas:
        dtype = DTYPES.get(m.get("dtype"))
        shape = m.get("shape")
        if dtype is None or not isinstance(shape, list) or min(shape, default=0) < 0:
            raise FrameError(f"a frame's tensor {m.get('name')!r}: bad dtype or shape {m}")
        if m.get("nbytes") != math.prod(shape) * dtype.itemsize:
            raise FrameError(f"a frame's tensor {m.get('name')!r}: {m} is not its size")
        total += m["nbytes"]
    if total != plen:
        raise FrameError(f"a frame's tensors hold {total} bytes, its prefix says {plen}")
    payload = _read_exact(sock, plen) if plen else bytearray()
    tensors, at = {}, 0
    for m in metas:
        dtype, n = DTYPES[m["dtype"]], m["nbytes"]
        count = n // dtype.itemsize
        t = torch.frombuffer(payload, dtype=dtype, count=count, offset=at) if n else None
        tensors[m["name"]] = (t if t is not None else torch.empty(0, dtype=dtype)).view(m["shape"])
        at += n
    return header, tensors
