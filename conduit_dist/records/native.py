"""The C extension ``conduit_dist._native._pack``, loaded once for the package.

``_native`` is the extension module (row packing and NaN/inf scans, splitmix64 draws and
allocations, the 8-ary trees, priority updates, trailers), or ``None`` in a source checkout that
was not built (``pip install -e .``): every caller then takes its torch path. Callers import it
as ``from conduit_dist.records.spec import _native`` (re-exported there) or from here.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("conduit_dist")

REQUIRED = (
    "any_nonfinite", "gather_rows", "mass_alloc", "pack_rows", "queue_updates", "read_trailer",
    "rows_nonfinite", "seq_back", "seq_link", "seq_nstep", "seq_windows", "tag_rows",
    "tree_sample", "tree_set", "tree_update", "uniform_alloc", "uniform_slots",
)  # fmt: skip
"""Functions called wherever the extension is loaded: a build without one of them is not used
at all (every caller takes its Python path, one warning naming what it lacks)."""

OPTIONAL: dict[str, str] = {
    "copy_spans": "shared memory is off (auto) or refused (True); token rounds gather their "
    "sections by a token index; the record header exchange copies span by span (ctypes)",
    "mean2_f32": "a round's payload mean takes torch's path (one more pass)",
    "seq_starts": "sequence starts are found with torch",
    "tree_fill": "sum-tree fills take torch's path",
    "unpack_rows": "sequence rows are unpacked with torch",
    "shm_wait": "shared memory is off (auto) or refused (True): it needs the native barrier",
    "shm_arrive": "shared memory is off (auto) or refused (True): it needs the native barrier",
    "shm_lock": "shared memory is off (auto) or refused (True): it needs the native barrier",
}
"""Functions added after the first builds, each with its own Python path where it is absent,
and what that path costs."""

FUNCTIONS = (*REQUIRED, *OPTIONAL)


def _rank() -> str:
    rank = os.environ.get("RANK")
    return f"rank {rank}: " if rank is not None else ""


_STALE = "(a build older than the source: run pip install -e .)"
try:
    from conduit_dist._native import _pack as _native
except ImportError:  # a source checkout that was not built: pip install -e .
    _native = None
    log.warning(
        "%sconduit_dist._native._pack is not built (run pip install -e .): every native "
        "function takes its Python path (python -m conduit_dist info lists them)",
        _rank(),
    )
else:  # a stale build: what it lacks is said on every rank that lacks it, never silently
    _lacks = [n for n in REQUIRED if not hasattr(_native, n)]
    if _lacks:
        _native = None
        log.warning(
            "%sconduit_dist._native._pack lacks %s %s: the extension is not used, every "
            "native function takes its Python path",
            _rank(),
            ", ".join(_lacks),
            _STALE,
        )
    else:
        for _name, _what in OPTIONAL.items():
            if not hasattr(_native, _name):
                log.warning(
                    "%sconduit_dist._native._pack lacks %s %s: %s",
                    _rank(),
                    _name,
                    _STALE,
                    _what,
                )


def native_state() -> dict[str, object]:
    """Which of :data:`FUNCTIONS` this process's extension has.

    Returns:
        ``{"built": bool, "native": [names present], "missing": [names absent]}``; every name
        is missing where the extension is not built.
    """
    have = [n for n in FUNCTIONS if _native is not None and hasattr(_native, n)]
    return {
        "built": _native is not None,
        "native": have,
        "missing": sorted(set(FUNCTIONS) - set(have)),
    }


NATIVE_MAX_FIELDS = 256  # MAX_FIELDS in _native/pack.c
KIND = {torch.float32: 4, torch.float64: 8, torch.float16: 2, torch.bfloat16: 3}
"""The extension's code of each floating dtype it scans for NaN/inf (0: not scanned)."""
