"""Read history keys and values back from a W&B offline run file (``run-*.wandb``).

The file is a 7-byte header followed by LevelDB-log framed records (32 KiB blocks, each record
chunk prefixed by crc32 (4 bytes), length (2) and type (1)); each record is a protobuf ``Record``.
"""

from __future__ import annotations

import json
import struct

_BLOCK, _HDR = 32768, 7


def _records(path: str):
    """Every protobuf ``Record`` of the run file, in order."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", f"not a W&B run file: {path}"
    pos, buf = _HDR, b""
    while pos + _HDR <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HDR:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HDR])
        pos += _HDR
        if kind == 0 and length == 0:
            break
        buf += data[pos : pos + length]
        pos += length
        if kind in (1, 4):  # FULL or LAST chunk: one whole record
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


def _items(items) -> dict[str, object]:
    return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}


def history(path: str) -> list[dict[str, object]]:
    """Every ``run.log`` row of the run, as ``{key: value}``."""
    return [
        _items(rec.history.item)
        for rec in _records(path)
        if rec.WhichOneof("record_type") == "history"
    ]


def summary(path: str) -> dict[str, object]:
    """The run's summary as the run left it (``run.summary[key] = value`` updates, in order)."""
    out: dict[str, object] = {}
    for rec in _records(path):
        if rec.WhichOneof("record_type") == "summary":
            out.update(_items(rec.summary.update))
    return out
