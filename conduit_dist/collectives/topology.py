"""Topology discovery: which ranks share a host, exchanged once at start.

A host is what the launcher says is a node (torchrun's ``GROUP_RANK``, else SLURM's
``SLURM_NODEID``), else the hostname: containers on different nodes often share a hostname.
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from conduit_dist.collectives.exchange import Exchange
from conduit_dist.errors import ConfigError

LINKS = ("self", "host", "net")  # same process, same host, across hosts
_NAME_BYTES = 128  # a host key on the wire (the node label first, so a cut hostname keeps it)
# launcher variables that number the nodes of a job, first found wins: (variable, label)
NODE_VARS = (("GROUP_RANK", "node"), ("SLURM_NODEID", "slurm-node"))


def host_key(env: Mapping[str, str], hostname: str) -> str:
    """The key that identifies this rank's host: equal on the ranks of one node, different
    across nodes.

    torchrun's node rank (``GROUP_RANK``: one per agent, i.e. per ``torchrun`` invocation), else
    SLURM's node index (``SLURM_NODEID``), labels the hostname: ``"node1@gpu-a"``. Without
    either (plain ``python``, another launcher) the hostname alone is the key, which merges
    nodes that share one (containers often do).

    Args:
        env: the environment (``os.environ``).
        hostname: this machine's hostname (``socket.gethostname()``).

    Returns:
        The host key.

    Raises:
        ConfigError: when the launcher's variable is not a non-negative integer.

    Example::

        host_key({"GROUP_RANK": "1"}, "worker")  # "node1@worker"
        host_key({}, "worker")  # "worker"
    """
    for var, label in NODE_VARS:
        raw = env.get(var)
        if raw is None:
            continue
        if not raw.strip().isdigit():
            raise ConfigError(
                f"environment variable {var}: expected the launcher's node index (an integer "
                f">= 0), got {raw!r}"
            )
        return f"{label}{int(raw)}@{hostname}"
    return hostname


@dataclass(frozen=True)
class Topology:
    """Hosts of every rank and the link class of every pair.

    Attributes:
        hosts: host key of each rank (:func:`host_key`: ``"node1@gpu-a"``, or a hostname).
        host_of: host index of each rank (0-based, in order of first appearance).
    """

    hosts: tuple[str, ...]
    host_of: tuple[int, ...]

    @property
    def world(self) -> int:
        """Number of ranks."""
        return len(self.hosts)

    @property
    def num_hosts(self) -> int:
        """Number of distinct hosts."""
        return len(set(self.hosts))

    def link(self, a: int, b: int) -> str:
        """Link class between ranks ``a`` and ``b``: ``self``, ``host`` or ``net``."""
        if a == b:
            return "self"
        return "host" if self.host_of[a] == self.host_of[b] else "net"

    def link_matrix(self) -> np.ndarray:
        """``[world, world]`` link class index (into :data:`LINKS`) of every pair."""
        h = np.array(self.host_of)
        m = np.where(h[:, None] == h[None, :], 1, 2)
        np.fill_diagonal(m, 0)
        return m

    def key(self) -> str:
        """A short stable key of the layout (for calibration caches)."""
        text = ",".join(self.hosts)
        return hashlib.sha1(text.encode()).hexdigest()[:12]

    @classmethod
    def single_host(cls, world: int, name: str = "localhost") -> Topology:
        """Every rank on one host."""
        return cls(tuple([name] * world), tuple([0] * world))

    @classmethod
    def from_hosts(cls, hosts: list[str]) -> Topology:
        """Build from each rank's host name."""
        order: dict[str, int] = {}
        for h in hosts:
            order.setdefault(h, len(order))
        return cls(tuple(hosts), tuple(order[h] for h in hosts))


def discover(ex: Exchange) -> Topology:
    """Exchange host keys once (:func:`host_key`): a collective on the exchange's group (CPU
    tensors, no pickle).

    Runs as the phase ``start-up: discover hosts``, with the exchange's timeout.

    Args:
        ex: the plane's collectives (every rank calls ``discover`` with its own).

    Returns:
        The job's :class:`Topology` (one host at world size 1).

    Raises:
        PhaseError: if a rank does not join within the exchange's timeout (naming the ranks that
            never entered the phase, where the rendezvous store can tell).
        ConfigError: on a malformed ``GROUP_RANK`` or ``SLURM_NODEID``.

    Example::

        topo = discover(Exchange(60.0))
        topo.link(0, 1)  # "host" or "net"
    """
    name = host_key(os.environ, socket.gethostname())
    if ex.world == 1:
        return Topology.from_hosts([name])
    raw = name.encode()[:_NAME_BYTES].ljust(_NAME_BYTES, b"\0")
    local = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    out = torch.empty(ex.world * _NAME_BYTES, dtype=torch.uint8)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # older torch
    with ex.phase("start-up: discover hosts"):
        ex.run(lambda: gather(out, local, group=ex.group, async_op=True), "all_gather(host names)")
    hosts = [
        bytes(out[i * _NAME_BYTES : (i + 1) * _NAME_BYTES].tolist())
        .rstrip(b"\0")
        .decode(errors="replace")
        for i in range(ex.world)
    ]
    return Topology.from_hosts(hosts)
