"""The C extension ``conduit_dist._native._pack``, loaded once for the package.

``_native`` is the extension module (row packing and NaN/inf scans, splitmix64 draws and
allocations, the 8-ary trees, priority updates, trailers), or ``None`` in a source checkout that
was not built (``pip install -e .``): every caller then takes its torch path. Callers import it
as ``from conduit_dist.records.spec import _native`` (re-exported there) or from here.
"""

from __future__ import annotations

import logging

import torch

try:
    from conduit_dist._native import _pack as _native
except ImportError:  # a source checkout that was not built: pip install -e .
    _native = None
    logging.getLogger("conduit_dist").warning(
        "conduit_dist._native._pack is not built (run pip install -e .): packing records uses "
        "torch's strided copies, slower for small fields"
    )

NATIVE_MAX_FIELDS = 256  # MAX_FIELDS in _native/pack.c
KIND = {torch.float32: 4, torch.float64: 8, torch.float16: 2, torch.bfloat16: 3}
"""The extension's code of each floating dtype it scans for NaN/inf (0: not scanned)."""
