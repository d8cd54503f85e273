"""Declared machines for the simulator: ranks per node, link classes, NIC sharing, tiers.

A :class:`SimTopology` turns into the two things the plane's own cost model takes, so the
simulator prices an exchange with the plane's formulas and nothing else:

- the link class of every pair of ranks, through the plane's
  :class:`~conduit_dist.collectives.topology.Topology` (ranks ``0 .. rpn-1`` on node 0, ...);
- a :class:`~conduit_dist.collectives.model.BandwidthModel`: declared numbers
  (:meth:`BandwidthModel.declared`: one latency per call, per message, GB/s per link class), or a
  calibrated model this machine measured and cached (``calibration: cache``).

A node's network bandwidth per rank is its NIC's GB/s over the ranks sharing it
(``nic_gbps / ranks_per_nic``). The YAML files in ``conf/topology/`` cite where each constant
comes from.
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from conduit_dist.collectives.model import BandwidthModel
from conduit_dist.collectives.model.cache import cache_path, load_cache
from conduit_dist.collectives.topology import Topology
from conduit_dist.errors import ConfigError
from conduit_dist.extras import require
from conduit_dist.registry import check_choice, check_count
from conduit_dist.tiers import KINDS

CONF_DIR = Path(__file__).resolve().parents[2] / "conf" / "topology"
_KEYS = {
    "name", "description", "ranks_per_node", "latency_us", "message_us", "self_gbps",
    "host_gbps", "nic_gbps", "ranks_per_nic", "h2d_gbps", "round_cpu_us", "exchange_cpu_us",
    "payload_gbps", "cores_per_node", "tier_gbps", "calibration", "sources",
}  # fmt: skip


@dataclass(frozen=True)
class SimTopology:
    """A declared machine.

    Attributes:
        name: short name (the YAML file's stem).
        ranks_per_node: ranks (GPUs, or processes) on one node.
        latency_us: microseconds per collective call.
        message_us: microseconds per message on the wire at the critical rank.
        self_gbps: a rank's copy to itself (device memory, or host memory on CPU).
        host_gbps: GB/s per rank between ranks of one node, all-to-all class (NVLink bus bandwidth).
        nic_gbps: GB/s of one network card, one direction.
        ranks_per_nic: ranks sharing one network card.
        h2d_gbps: pinned host-to-device GB/s (host tiers feeding a GPU; 0: none).
        tier_gbps: ``kind -> [read, write]`` GB/s of a rank's share of each memory tier
            (``device``, ``pinned``, ``host``, ``disk``; the plane's ``tier_gbps`` setting);
            empty: tiers not priced (their reads are in the measured bookkeeping).
        round_cpu_us: the plane's host bookkeeping of a one-exchange round outside its
            collective (``bench rounds``: a fused round's time over its raw all-to-all's).
        exchange_cpu_us: the bookkeeping each further exchange of a general round adds (its
            planning, pack and unpack; ``bench rounds``: the three-exchange round's over the
            fused one's, per extra exchange).
        payload_gbps: GB/s at which the bookkeeping handles a gradient payload riding in the
            round (packing it, averaging the learners', unpacking; 0: free).
        cores_per_node: cores the ranks of a node share (0: at least one per rank; ``auto`` in
            YAML: this machine's). Where a node runs more ranks than cores the bookkeeping
            takes ``ranks / cores`` times as long (the ranks' Python shares the cores); the
            collectives' own costs come from a model calibrated at that load, or declared for
            a machine with a core per rank.
        calibration: ``declared`` (the numbers above) or ``cache`` (this machine's calibrated
            model for the world size, from the plane's calibration cache).
        sources: where each constant comes from.
    """

    name: str
    ranks_per_node: int
    latency_us: float
    message_us: float
    self_gbps: float
    host_gbps: float
    nic_gbps: float
    ranks_per_nic: int = 1
    h2d_gbps: float = 0.0
    round_cpu_us: float = 0.0
    exchange_cpu_us: float = 0.0
    payload_gbps: float = 0.0
    cores_per_node: int = 0
    tier_gbps: dict[str, list[float]] = field(default_factory=dict)
    calibration: str = "declared"
    description: str = ""
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key, low in (("ranks_per_node", 1), ("ranks_per_nic", 1), ("cores_per_node", 0)):
            check_count(f"topology {self.name!r} {key}", getattr(self, key), low)
        for key in ("self_gbps", "host_gbps", "nic_gbps"):
            v = getattr(self, key)
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise ConfigError(f"topology {self.name!r} {key}: expected GB/s > 0, got {v!r}")
        for key in ("latency_us", "message_us", "h2d_gbps", "round_cpu_us", "exchange_cpu_us",
                    "payload_gbps"):  # fmt: skip
            v = getattr(self, key)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise ConfigError(
                    f"topology {self.name!r} {key}: expected a number >= 0, got {v!r}"
                )
        if not isinstance(self.tier_gbps, dict):
            raise ConfigError(
                f"topology {self.name!r} tier_gbps: expected a mapping kind -> [read, write] "
                f"GB/s, got {self.tier_gbps!r}"
            )
        for kind, rw in self.tier_gbps.items():
            ok = isinstance(rw, list | tuple) and len(rw) == 2
            if (
                kind not in KINDS
                or not ok
                or not all(isinstance(v, int | float) and math.isfinite(v) and v > 0 for v in rw)
            ):
                raise ConfigError(
                    f"topology {self.name!r} tier_gbps[{kind!r}]: expected a kind of "
                    f"{list(KINDS)} with [read, write] GB/s > 0, got {rw!r}"
                )
        check_choice(f"topology {self.name!r} calibration", self.calibration, ("declared", "cache"))

    def oversubscription(self, world: int) -> float:
        """How many times longer the bookkeeping takes on the busiest node of ``world`` ranks:
        its ranks over its cores, at least 1."""
        if not self.cores_per_node:
            return 1.0
        return max(1.0, min(world, self.ranks_per_node) / self.cores_per_node)

    @property
    def net_gbps(self) -> float:
        """Network GB/s per rank: the NIC's over the ranks sharing it."""
        return self.nic_gbps / self.ranks_per_nic

    def layout(self, world: int) -> Topology:
        """The plane's topology of ``world`` ranks, ``ranks_per_node`` to a node."""
        if world < 1:
            raise ConfigError(f"world: expected >= 1 ranks, got {world}")
        return Topology.from_hosts([f"node{r // self.ranks_per_node}" for r in range(world)])

    def links(self, world: int) -> np.ndarray:
        """``[world, world]`` link class index of every pair (the plane's ``link_matrix``)."""
        return self.layout(world).link_matrix()

    def model(
        self, world: int, cache_dir: str | None = None, hosts: list[str] | None = None
    ) -> BandwidthModel:
        """The cost model of ``world`` ranks on this machine.

        Args:
            world: ranks.
            cache_dir: the calibration cache (``calibration: cache``).
            hosts: the host key of every rank the calibration ran with (``calibration:
                cache``; default: one torchrun node on this machine, ``node0@<hostname>``).

        Raises:
            ConfigError: ``calibration: cache`` without a calibration cached for ``world``
                ranks of this layout in ``cache_dir`` (run the plane once at that size).
        """
        if self.calibration == "declared":
            gbps = {"self": self.self_gbps, "host": self.host_gbps, "net": self.net_gbps}
            return BandwidthModel.declared(self.latency_us * 1e-6, gbps, self.message_us * 1e-6)
        cache_dir = os.path.expanduser(cache_dir or "~/.cache/conduit_dist")
        if hosts is None:
            if world > self.ranks_per_node:
                raise ConfigError(
                    f"topology {self.name!r}: a calibrated model of this machine covers one host "
                    f"of at most {self.ranks_per_node} ranks, got {world} (pass the hosts of a "
                    "multi-host calibration)"
                )
            # the key torchrun's ranks on this machine use (node 0 of a single-node torchrun)
            hosts = [f"node0@{socket.gethostname()}"] * world
        if len(hosts) != world:
            raise ConfigError(f"hosts: expected {world} host keys (one per rank), got {len(hosts)}")
        topo = Topology.from_hosts(list(hosts))
        path = cache_path(cache_dir, "gloo", topo)
        model = load_cache(path, "gloo", topo) if os.path.exists(path) else None
        if model is None:
            raise ConfigError(
                f"topology {self.name!r}: no calibrated model for {world} ranks at {path}; run "
                f"the plane once at that size (any torchrun job with plane.calibrate=true), or "
                "declare the numbers (calibration: declared)"
            )
        return model


def load(name_or_path: str) -> SimTopology:
    """A topology from ``conf/topology/<name>.yaml`` or a YAML path.

    Raises:
        ConfigError: an unknown name (listing the known ones), an unknown key, a missing or bad
            value.
    """
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = CONF_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in CONF_DIR.glob("*.yaml"))
        raise ConfigError(f"topology: expected one of {known} or a YAML path, got {name_or_path!r}")
    with require("train", "conduit_dist.sim"):  # PyYAML comes with Hydra
        import yaml
    raw = yaml.safe_load(path.read_text()) or {}
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise ConfigError(
            f"topology {path.name}: unknown keys {unknown} (expected {sorted(_KEYS)})"
        )
    raw.setdefault("name", path.stem)
    if raw.get("cores_per_node") == "auto":  # this machine's cores
        raw["cores_per_node"] = os.cpu_count() or 1
    try:
        return SimTopology(**raw)
    except TypeError as exc:  # a missing required key
        raise ConfigError(f"topology {path.name}: {exc}") from exc


def names() -> list[str]:
    """The declared topologies in ``conf/topology/``."""
    return sorted(p.stem for p in CONF_DIR.glob("*.yaml"))
