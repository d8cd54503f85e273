"""``python -m conduit_dist info``: what a plane would find and choose on this job.

Every rank takes part (host discovery, the bandwidth model, the tier numbers are collectives);
rank 0 prints. The parts are the plane's own: :func:`~conduit_dist.collectives.topology.discover`,
:func:`~conduit_dist.collectives.model.build` with the declared numbers ``assembly.DECLARED``
(or a calibration, cached as the plane caches it), :func:`~conduit_dist.tiers.make_tier`'s
calibration, and :meth:`~conduit_dist.collectives.transport.Transport.choose` on the probe
patterns of ``model.probe_matrices``.

Example::

    report = collect(calibrate=False, bandwidth_cache="~/.cache/conduit_dist")
    print(format_report(report))
"""

from __future__ import annotations

import os
import platform
import shutil
import tempfile

import numpy as np
import torch
import torch.distributed as dist

from conduit_dist.collectives.exchange import Exchange
from conduit_dist.collectives.model import (
    FEATURES,
    BandwidthModel,
    build,
    cache_path,
    probe_matrices,
)
from conduit_dist.collectives.strategies import NAMES
from conduit_dist.collectives.topology import LINKS, Topology, discover
from conduit_dist.collectives.transport import Transport
from conduit_dist.errors import ConfigError
from conduit_dist.plane.build import DECLARED
from conduit_dist.tiers import make_tier

SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20)  # bytes per peer
# probe_matrices' patterns shown: every rank to every rank, and every rank to rank 0
PATTERNS = {"uniform": "every rank -> every rank", "hot": "every rank -> rank 0"}
TIER_BYTES = 16 << 20  # what Tier.calibrate writes and gathers at most


def tier_kinds() -> tuple[str, ...]:
    """The tier kinds this machine can build: ``host``, ``disk``, and with CUDA ``pinned``,
    ``device`` (fastest first, as in ``tiers.KINDS``)."""
    cuda = ("device", "pinned") if torch.cuda.is_available() else ()
    return (*cuda, "host", "disk")


def measure_tiers(record_bytes: int, disk_dir: str | None) -> dict[str, dict[str, object]]:
    """Read (random-row gather) and write GB/s of every tier kind, as a tier measures itself at
    start-up (``Tier.calibrate``: up to 16 MiB, best of 3).

    Args:
        record_bytes: bytes per record (the gather reads whole rows).
        disk_dir: directory of the disk tier's file (``None``: a temporary directory, removed).

    Returns:
        ``kind -> {"read_gbps", "write_gbps", "source"}``.

    Raises:
        ConfigError: if a tier cannot be built (e.g. ``disk_dir`` cannot hold the file).
    """
    slots = max(1, TIER_BYTES // record_bytes)
    tmp = tempfile.mkdtemp(prefix="conduit-info-") if disk_dir is None else None
    out: dict[str, dict[str, object]] = {}
    try:
        for kind in tier_kinds():
            device = torch.device("cuda" if kind == "device" else "cpu")
            tier = make_tier(kind, slots, record_bytes, device, disk_dir or tmp)
            try:
                out[kind] = {
                    "read_gbps": tier.read_gbps,
                    "write_gbps": tier.write_gbps,
                    "source": tier.bandwidth_source,
                }
            finally:
                tier.close()
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _gather_tiers(ex: Exchange, topo: Topology, mine: dict | None) -> dict[str, dict]:
    """Every host's tier numbers (measured by the first rank on each host), on every rank."""
    kinds = tier_kinds()
    row = torch.zeros(ex.world, 2 * len(kinds), dtype=torch.float64)
    if mine is not None:
        for j, kind in enumerate(kinds):
            row[ex.rank, 2 * j] = mine[kind]["read_gbps"]
            row[ex.rank, 2 * j + 1] = mine[kind]["write_gbps"]
    if ex.world > 1:
        with ex.phase("info: tier bandwidths"):
            ex.run(
                lambda: dist.all_reduce(row, group=ex.group, async_op=True),
                "all_reduce(tier bandwidths)",
            )
    hosts: dict[str, dict] = {}
    for host in dict.fromkeys(topo.hosts):
        r = topo.hosts.index(host)  # the first rank on that host measured it
        hosts[host] = {
            kind: {
                "read_gbps": float(row[r, 2 * j]),
                "write_gbps": float(row[r, 2 * j + 1]),
                "measured_by_rank": r,
            }
            for j, kind in enumerate(kinds)
        }
    return hosts


def _backend(ex: Exchange) -> str | None:
    if ex.group is not None:
        return str(dist.get_backend(ex.group))
    return str(dist.get_backend()) if dist.is_initialized() else None


def _topology(topo: Topology) -> dict[str, object]:
    names = np.array(LINKS)[topo.link_matrix()]
    return {
        "world": topo.world,
        "num_hosts": topo.num_hosts,
        "hosts": list(dict.fromkeys(topo.hosts)),
        "ranks_per_host": {h: topo.hosts.count(h) for h in dict.fromkeys(topo.hosts)},
        "host_of": list(topo.host_of),
        "links": names.tolist(),
    }


def _bandwidth(
    ex: Exchange, topo: Topology, calibrate: bool, cache: str | None
) -> tuple[BandwidthModel, dict[str, object]]:
    """The model a plane with ``bandwidth="calibrate"`` (or ``"declared"``) would use."""
    declared = BandwidthModel.declared(*DECLARED)
    model, seconds = build(ex, topo, calibrate, cache, declared)
    backend = _backend(ex)
    path = cache_path(cache, backend, topo) if cache and backend and ex.world > 1 else None
    if not calibrate:
        note = "declared numbers (bandwidth='declared', the library default); --calibrate probes"
    elif ex.world == 1:
        note = "world size 1 never calibrates (nothing moves between ranks): declared numbers"
    elif model.source == "cache":
        note = "every rank read a valid calibration cache"
    else:
        note = f"probed the links now ({seconds:.2f} s), cached for the next start"
    return model, {
        "requested": "calibrate" if calibrate else "declared",
        "source": model.source,
        "note": note,
        "seconds": seconds,
        "describe": model.describe(),
        "cache_path": path,
        "cache_exists": bool(path and os.path.exists(path)),
        "features": list(FEATURES),
        "coef": model.to_json(),
    }


def _strategies(ex: Exchange, topo: Topology, model: BandwidthModel) -> dict[str, object]:
    """What the plane's transport would pick for each probe pattern and size (at world size 1
    nothing: a round there runs no collective)."""
    transport = Transport(ex, topo, model)
    rows = []
    for pattern in PATTERNS:
        for size in SIZES:
            row: dict[str, object] = {"pattern": pattern, "per_peer_bytes": size}
            if ex.world > 1:
                matrix = probe_matrices(ex.world, size)[pattern]
                name, seconds = transport.choose(matrix)
                preds = {n: model.predict(n, matrix, transport.links) * 1e3 for n in NAMES}
                row.update(
                    strategy=name, predicted_ms=seconds * 1e3, predicted_ms_by_strategy=preds
                )
            else:
                row.update(strategy=None, predicted_ms=None, predicted_ms_by_strategy={})
            rows.append(row)
    return {"names": list(NAMES), "patterns": PATTERNS, "rows": rows}


def _versions(device: torch.device) -> dict[str, object]:
    from conduit_dist import __version__
    from conduit_dist.records.native import native_state

    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "conduit_dist": __version__,
        "numpy": np.__version__,
        "native_extension": native_state(),
        "device": str(device),
        "cuda_available": cuda,
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if cuda
        else [],
        "cpu_count": os.cpu_count(),
        "host": platform.node(),
    }


def collect(
    *,
    calibrate: bool = False,
    bandwidth_cache: str | None = "~/.cache/conduit_dist",
    disk_dir: str | None = None,
    record_bytes: int = 1024,
    timeout_s: float = 60.0,
    device: str | torch.device = "cpu",
) -> dict[str, object]:
    """Discover the topology, build the bandwidth model, measure the tiers, price strategies.

    Collective: every rank calls it (under torchrun after ``init_distributed``; plain
    ``python`` is world size 1 and needs no process group). Every rank returns the report.

    Args:
        calibrate: build the model as ``DataPlane(bandwidth="calibrate")`` does (probe the
            links unless every rank has a valid cache; never at world size 1).
        bandwidth_cache: directory of calibration caches (``None``: no cache).
        disk_dir: directory of the disk tier measured (``None``: a temporary one).
        record_bytes: record size of the tiers measured.
        timeout_s: seconds any collective may take.
        device: the plane's device (shown; sets nothing up).

    Returns:
        A JSON-ready dict: ``versions``, ``backend``, ``world_size``, ``topology``,
        ``bandwidth``, ``tiers``, ``strategies``.

    Raises:
        ConfigError: on a bad ``record_bytes`` or a disk directory that cannot hold the file.
        PhaseError: if a rank does not join a collective within ``timeout_s``.

    Example::

        report = collect(calibrate=True, bandwidth_cache="/tmp/cd-cache")
        report["strategies"]["rows"][0]["strategy"]  # e.g. "all_to_all"
    """
    if not isinstance(record_bytes, int) or record_bytes < 8 or record_bytes % 8:
        raise ConfigError(f"record_bytes: expected a multiple of 8 >= 8, got {record_bytes!r}")
    ex = Exchange(timeout_s, name="info")
    try:
        topo = discover(ex)
        model, bandwidth = _bandwidth(ex, topo, calibrate, bandwidth_cache)
        first_on_host = topo.host_of.index(topo.host_of[ex.rank]) == ex.rank
        mine = measure_tiers(record_bytes, disk_dir) if first_on_host else None
        tiers = _gather_tiers(ex, topo, mine)
        return {
            "versions": _versions(torch.device(device)),
            "backend": _backend(ex),
            "world_size": ex.world,
            "topology": _topology(topo),
            "bandwidth": bandwidth,
            "tiers": {
                "record_bytes": record_bytes,
                "measured_bytes": max(1, TIER_BYTES // record_bytes) * record_bytes,
                "disk_dir": disk_dir or "(a temporary directory)",
                "hosts": tiers,
            },
            "strategies": _strategies(ex, topo, model),
        }
    finally:
        ex.close()


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _cache_line(bw: dict, world: int) -> str:
    if world == 1:
        return "none (world size 1 never calibrates)"
    if bw["cache_path"] is None:
        return "none (bandwidth_cache=None)"
    return f"{bw['cache_path']} ({'exists' if bw['cache_exists'] else 'not written yet'})"


def _native_line(state: dict) -> str:
    if not state["built"]:
        return "native extension: not built (pip install -e .); every function takes Python"
    if not state["missing"]:
        return f"native extension: all {len(state['native'])} functions"
    return (
        f"native extension: {len(state['native'])} functions; missing (Python path): "
        + ", ".join(state["missing"])
    )


def format_report(r: dict) -> str:
    """The report as the lines ``python -m conduit_dist info`` prints."""
    v, topo, bw = r["versions"], r["topology"], r["bandwidth"]
    gpus = ", ".join(v["cuda_devices"]) or "none"
    lines = [
        f"conduit_dist {v['conduit_dist']}  torch {v['torch']}  python {v['python']}  "
        f"numpy {v['numpy']}",
        _native_line(v["native_extension"]),
        f"device {v['device']}  cuda: {gpus}  cpus: {v['cpu_count']}",
        f"backend {r['backend'] or 'none (no process group)'}  world size {r['world_size']}",
        "",
        f"topology: {topo['num_hosts']} host(s)",
    ]
    for host, n in topo["ranks_per_host"].items():
        ranks = [i for i, h in enumerate(topo["host_of"]) if topo["hosts"][h] == host]
        lines.append(f"  {host}: {n} rank(s) {ranks}")
    lines.append("  link class [src][dst]:")
    for i, row in enumerate(topo["links"]):
        lines.append(f"    {i:>3}: " + " ".join(f"{c:>4}" for c in row))
    lines += [
        "",
        f"bandwidth model: {bw['source']} ({bw['note']})",
        f"  {bw['describe']}",
        "  cache: " + _cache_line(bw, r["world_size"]),
        "",
        f"tiers (GB/s read / write, {_size(r['tiers']['measured_bytes'])} of "
        f"{r['tiers']['record_bytes']}-byte records; disk in {r['tiers']['disk_dir']}):",
    ]
    for host, kinds in r["tiers"]["hosts"].items():
        cells = [f"{k} {t['read_gbps']:.2f} / {t['write_gbps']:.2f}" for k, t in kinds.items()]
        lines.append(f"  {host}: " + ", ".join(cells))
    lines += ["", "strategy the model picks (predicted ms of one exchange):"]
    st = r["strategies"]
    if r["world_size"] == 1:
        lines.append("  none: at world size 1 a round runs no collective")
        return "\n".join(lines)
    for pattern, text in st["patterns"].items():
        cells = [
            f"{_size(row['per_peer_bytes'])}: {row['strategy']} {row['predicted_ms']:.3f}"
            for row in st["rows"]
            if row["pattern"] == pattern
        ]
        lines.append(f"  {pattern} ({text}), per peer: " + "; ".join(cells))
    return "\n".join(lines)
