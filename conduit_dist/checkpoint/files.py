"""A checkpoint on disk: its directory, files, manifest, checks, and finding the latest one.

``ROOT/ckpt-RRRRRRRRR/`` (``R``: the round) holds per old rank ``j``:

- ``shard{j}.items``: its live items' records, oldest first (raw bytes, no pickle);
- ``shard{j}.pt``: everything else (``torch.save`` of tensors, ints and dicts: loads with
  ``weights_only=True``): counters, sampler, per-item sampler state, versions, the caller's
  ``extra``;
- ``shard{j}.done.json``: its sizes and CRC-32s, written once both files are on disk;

and ``manifest.json``, written last by rank 0 once every rank's ``done`` file is there. Ranks
write into ``ckpt-R.TOKEN.tmp/``; rank 0 renames it to ``ckpt-R`` after the manifest, so a directory
without ``.tmp`` is complete (a kill mid-write leaves a ``.tmp`` directory, which is ignored and
removed by the next checkpoint).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib

from conduit_dist.errors import CheckpointError

FORMAT = 1
_NAME = re.compile(r"^ckpt-(\d{9,})$")


def directory(root: str, round: int, token: int | None = None) -> str:
    """The checkpoint directory of ``round`` under ``root``; with ``token`` (agreed by the
    ranks for this attempt) the one it is written in, ``ckpt-R.TOKEN.tmp``."""
    name = f"ckpt-{round:09d}" + ("" if token is None else f".{token:016x}.tmp")
    return os.path.join(root, name)


def crc_file(path: str, chunk: int = 16 << 20) -> tuple[int, int]:
    """``(bytes, crc32)`` of a file."""
    crc, n = 0, 0
    with open(path, "rb") as f:
        while buf := f.read(chunk):
            crc, n = zlib.crc32(buf, crc), n + len(buf)
    return n, crc


def write_json(path: str, obj: dict) -> None:
    """Write ``obj`` as JSON atomically (a temporary name, fsync, rename)."""
    tmp = path + ".part"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(path: str) -> dict:
    """The manifest of checkpoint directory ``path``.

    Raises:
        CheckpointError: if it is missing, unreadable or of another format.
    """
    try:
        with open(os.path.join(path, "manifest.json")) as f:
            man = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: no readable manifest.json ({e})") from e
    if man.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {path}: manifest format {man.get('format')!r}, expected {FORMAT}"
        )
    return man


def verify(path: str, man: dict, ranks, kinds=("items", "meta")) -> None:
    """Check the files (``kinds``) of old ranks ``ranks`` against the manifest (sizes,
    CRC-32).

    Raises:
        CheckpointError: naming the first file that is missing or differs.
    """
    for j in ranks:
        entry = man["shards"][j]
        for kind in kinds:
            name = entry[kind]["file"]
            try:
                got = crc_file(os.path.join(path, name))
            except OSError as e:
                raise CheckpointError(f"checkpoint {path}: {name} unreadable ({e})") from e
            want = (entry[kind]["bytes"], entry[kind]["crc32"])
            if got != want:
                raise CheckpointError(
                    f"checkpoint {path}: {name} has (bytes, crc32) {got}, manifest says {want} "
                    "(torn or corrupted)"
                )


def complete(root: str) -> list[str]:
    """Complete checkpoint directories under ``root``, newest first (by round)."""
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), n) for n in os.listdir(root) if (m := _NAME.match(n))]
    return [os.path.join(root, n) for _, n in sorted(found, reverse=True)]


def latest(root: str) -> str | None:
    """The newest checkpoint under ``root`` with a manifest of this format (``None``: none)."""
    for path in complete(root):
        try:
            read_manifest(path)
        except CheckpointError:
            continue
        return path
    return None


def prune(root: str, keep: int, current: str) -> None:
    """Remove all but the newest ``keep`` complete checkpoints, and unfinished ``.tmp``
    directories other than ``current``'s."""
    for path in complete(root)[keep:]:
        shutil.rmtree(path, ignore_errors=True)
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.endswith(".tmp") and path != current:
            shutil.rmtree(path, ignore_errors=True)


def set_aside(root: str, round: int) -> None:
    """Move complete checkpoints of rounds after ``round`` to ``root/set_aside/`` (a restore went
    back to ``round``: they are another timeline's, kept for inspection, not restored)."""
    for path in complete(root):
        m = _NAME.match(os.path.basename(path))
        if m and int(m.group(1)) > round:
            os.makedirs(os.path.join(root, "set_aside"), exist_ok=True)
            os.replace(path, os.path.join(root, "set_aside", os.path.basename(path)))
