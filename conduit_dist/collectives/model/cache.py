"""The calibration cache: one JSON file per backend, world size and host layout.

A calibrated :class:`~conduit_dist.collectives.model.costs.BandwidthModel` is written by the first
rank of each host (atomically) and read back by the next job on the same layout; a file that is
missing, corrupt, of another :data:`CACHE_VERSION` or for another layout is ignored with a warning.
A network knee (``burst_bytes``, ``over_s``) is kept beside the coefficients; a file without
one has none.
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np

from conduit_dist.collectives.model.costs import FEATURES, BandwidthModel
from conduit_dist.collectives.strategies import NAMES
from conduit_dist.collectives.topology import Topology

log = logging.getLogger("conduit_dist")

CACHE_VERSION = 5  # 4: probes rest on network links, 64 KB probed, a network knee; 5: a knee
# per strategy (a version-4 cache held one knee for all)


def cache_path(cache_dir: str, backend: str, topo: Topology) -> str:
    """Where the calibration of this backend, world size and host layout is cached."""
    return os.path.join(
        os.path.expanduser(cache_dir), f"bandwidth-{backend}-w{topo.world}-{topo.key()}.json"
    )


def load_cache(path: str, backend: str, topo: Topology) -> BandwidthModel | None:
    """The cached model, or ``None`` (with a warning) if missing, corrupt or for another layout."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("version") != CACHE_VERSION or data.get("backend") != backend:
            raise ValueError(f"version/backend {data.get('version')}/{data.get('backend')}")
        if data.get("world") != topo.world or data.get("hosts") != topo.key():
            raise ValueError(f"layout world={data.get('world')} hosts={data.get('hosts')}")
        coef = {n: np.array(data["coef"][n], dtype=np.float64) for n in NAMES}
        if any(c.shape != (len(FEATURES),) or not np.isfinite(c).all() for c in coef.values()):
            raise ValueError("bad coefficient vector")
        burst = {n: float(v) for n, v in data.get("burst_bytes", {}).items() if n in NAMES}
        over = {n: float(v) for n, v in data.get("over_s", {}).items() if n in NAMES}
        model = BandwidthModel(coef, "cache", burst, over)
    except Exception as exc:
        log.warning("bandwidth cache %s ignored (%s); re-probing", path, exc)
        return None
    return model


def save_cache(path: str, model: BandwidthModel, backend: str, topo: Topology) -> None:
    """Write the model (atomically)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    data = {
        "version": CACHE_VERSION,
        "backend": backend,
        "world": topo.world,
        "hosts": topo.key(),
        "features": list(FEATURES),
        "coef": model.to_json(),
        "burst_bytes": model.burst_bytes,
        "over_s": model.over_s,
    }
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
