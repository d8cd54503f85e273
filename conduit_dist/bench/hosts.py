"""Emulated hosts on one machine (``../shared/multihost.md``): network namespaces joined by veth
links, each host with its own hostname, the links optionally rate-limited with ``tc tbf``.

Two hosts are joined by one veth pair (no bridge). :meth:`EmulatedHosts.launch` starts one
``torchrun --nnodes=N --node_rank=i`` per host, gloo bound to the host's interface, and returns
what each host printed. Everything made is removed on exit, also on failure: the namespaces, and
what still runs in them (ranks that torchrun started in sessions of their own can outlive it).

Example::

    with EmulatedHosts(rate_mbit=800) as hosts:
        outs = hosts.launch(["-m", "conduit_dist.bench", "rounds"], nproc_per_node=2)
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from conduit_dist.errors import ConfigError

NAMES = ("hostA", "hostB")
log = logging.getLogger("conduit_dist")


class HostsUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no ``ip``/``unshare``/``tc``, or refused)."""


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


class EmulatedHosts:
    """Two emulated hosts: ``hosts`` is ``[(namespace, interface, address)]``, host 0 first.

    Args:
        rate_mbit: the link's rate each way (``tc tbf``; ``None``: unshaped veth).
        names: each host's hostname.

    Raises:
        ConfigError: a rate that is not a positive number of Mbit/s, or not two names.
        HostsUnavailable: on entering, where namespaces cannot be made.
    """

    def __init__(self, rate_mbit: float | None = None, names: tuple[str, str] = NAMES) -> None:
        if rate_mbit is not None and not rate_mbit > 0:
            raise ConfigError(f"rate_mbit: expected > 0 Mbit/s or None, got {rate_mbit!r}")
        if len(names) != 2:
            raise ConfigError(f"names: expected two hostnames, got {names!r}")
        self.rate_mbit, self.names = rate_mbit, tuple(names)
        tag = uuid.uuid4().hex[:8]
        subnet = f"10.213.{os.getpid() % 250}"
        self.hosts = [(f"cdA{tag}", "va", f"{subnet}.1"), (f"cdB{tag}", "vb", f"{subnet}.2")]
        self._made: list[str] = []

    def __enter__(self) -> EmulatedHosts:
        if os.geteuid() != 0:
            raise HostsUnavailable("emulated hosts need root (network namespaces)")
        for tool in ("ip", "unshare") + (("tc",) if self.rate_mbit else ()):
            if shutil.which(tool) is None:
                raise HostsUnavailable(f"emulated hosts need {tool!r}, not found on PATH")
        try:
            self._build()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _build(self) -> None:
        for ns, _, _ in self.hosts:
            res = _ip("netns", "add", ns)
            if res.returncode != 0:
                raise HostsUnavailable(f"cannot create network namespaces: {res.stderr.strip()}")
            self._made.append(ns)
        (a, va, _), (b, vb, _) = self.hosts
        steps = [("link", "add", va, "netns", a, "type", "veth", "peer", "name", vb, "netns", b)]
        for ns, dev, addr in self.hosts:
            steps += [
                ("-n", ns, "addr", "add", f"{addr}/24", "dev", dev),
                ("-n", ns, "link", "set", "lo", "up"),
                ("-n", ns, "link", "set", dev, "up"),
            ]
        for step in steps:
            res = _ip(*step)
            if res.returncode != 0:
                raise HostsUnavailable(f"ip {' '.join(step)}: {res.stderr.strip()}")
        if self.rate_mbit:
            for ns, dev, _ in self.hosts:
                shape = f"rate {self.rate_mbit}mbit burst 256kb latency 100ms".split()
                cmd = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf"]
                cmd += shape
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
                if res.returncode != 0:
                    raise HostsUnavailable(f"{' '.join(cmd)}: {res.stderr.strip()}")

    def __exit__(self, *exc) -> None:
        made, self._made = self._made, []
        for ns in made:  # each namespace alone: one that fails does not keep the rest
            try:
                self._kill_inside(ns)
            finally:
                try:
                    res = _ip("netns", "del", ns)
                    if res.returncode != 0:
                        log.warning("emulated hosts: ip netns del %s: %s", ns, res.stderr.strip())
                except subprocess.SubprocessError as err:
                    log.warning("emulated hosts: ip netns del %s: %s", ns, err)

    @staticmethod
    def _kill_inside(ns: str) -> None:
        """SIGKILL what still runs in ``ns`` (ranks torchrun started in sessions of their own
        can outlive a killed torchrun)."""
        for pid in _ip("netns", "pids", ns).stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)

    def host_keys(self, nproc_per_node: int) -> list[str]:
        """Every rank's host key as the plane discovers it (``node<i>@<hostname>``)."""
        return [
            f"node{i}@{name}" for i, name in enumerate(self.names) for _ in range(nproc_per_node)
        ]

    def launch(
        self,
        args: list[str],
        nproc_per_node: int,
        log_dir: str | Path,
        timeout_s: float = 300.0,
        env: dict[str, str] | None = None,
        port: int = 29500,
    ) -> list[str]:
        """Run ``python <args>`` under torchrun on both hosts; every host's output.

        Args:
            args: what follows ``python`` (``["-m", "pkg", ...]`` or ``["prog.py", ...]``).
            nproc_per_node: ranks per host.
            log_dir: where each host's output goes (``node<i>.log``).
            timeout_s: both hosts must be done by then.
            env: the environment (default: this process's).
            port: the rendezvous port on host 0.

        Returns:
            Each host's output (stdout and stderr), host 0 first.

        Raises:
            RuntimeError: a host that exits non-zero or does not finish in time (with the
                tails of both logs); both are stopped first.
        """
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        master = self.hosts[0][2]
        procs, paths = [], []
        try:
            for node, ((ns, dev, _), name) in enumerate(zip(self.hosts, self.names, strict=True)):
                torchrun = [
                    sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                    f"--node_rank={node}", f"--nproc_per_node={nproc_per_node}",
                    f"--master_addr={master}", f"--master_port={port}", *args,
                ]  # fmt: skip
                inner = f"hostname {shlex.quote(name)} && exec {shlex.join(torchrun)}"
                child = dict(os.environ if env is None else env, GLOO_SOCKET_IFNAME=dev)
                path = log_dir / f"node{node}.log"
                paths.append(path)
                with open(path, "w") as log:
                    cmd = ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", inner]
                    procs.append(subprocess.Popen(
                        cmd, stdout=log, stderr=subprocess.STDOUT, env=child,
                        start_new_session=True,
                    ))  # fmt: skip
            deadline = time.monotonic() + timeout_s
            for p in procs:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise RuntimeError(
                        f"the emulated hosts did not finish within {timeout_s:.0f}s:\n"
                        + _tails(paths)
                    ) from None
            codes = [p.returncode for p in procs]
            if codes != [0, 0]:
                raise RuntimeError(f"torchrun exit codes {codes}:\n{_tails(paths)}")
        finally:
            for p in procs:  # torchrun stops its ranks on SIGTERM; leftovers die with the
                if p.poll() is None:  # namespace (__exit__)
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait(timeout=15)
        return [p.read_text() for p in paths]


def start_elastic(
    hosts: EmulatedHosts,
    args: list[str],
    nproc_per_node: int,
    log_dir: str | Path,
    env: dict[str, str] | None = None,
    port: int = 29511,
    max_restarts: int = 3,
) -> list[subprocess.Popen]:
    """Start ``python <args>`` under an elastic torchrun on both hosts (``--nnodes=1:2``, the
    c10d rendezvous on host 0, ``--max-restarts``): a host that is lost (:func:`kill_host`)
    makes the other restart its ranks on its own. Each host sees the other's name in its
    ``/etc/hosts`` (c10d resolves hostnames) and advertises its address to attached producers
    (``CONDUIT_ADVERTISE_HOST``). Returns the two torchrun processes (output in
    ``log_dir/node<i>.log``); :meth:`EmulatedHosts.__exit__` kills what is left."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    hosts_file = log_dir / "hosts"
    hosts_file.write_text("127.0.0.1 localhost\n" + "".join(
        f"{addr} {name}\n" for (_, _, addr), name in zip(hosts.hosts, hosts.names, strict=True)
    ))  # fmt: skip
    master = hosts.hosts[0][2]
    procs = []
    for node, ((ns, dev, addr), name) in enumerate(zip(hosts.hosts, hosts.names, strict=True)):
        torchrun = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2",
            f"--nproc_per_node={nproc_per_node}", f"--max-restarts={max_restarts}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={master}:{port}", "--rdzv-id=elastic",
            "--rdzv-conf=last_call_timeout=3,join_timeout=120", f"--local-addr={addr}", *args,
        ]  # fmt: skip
        inner = (
            f"mount --bind {shlex.quote(str(hosts_file))} /etc/hosts && "
            f"hostname {shlex.quote(name)} && exec {shlex.join(torchrun)}"
        )
        child = dict(os.environ if env is None else env, GLOO_SOCKET_IFNAME=dev,
                     CONDUIT_ADVERTISE_HOST=addr)  # fmt: skip
        with open(log_dir / f"node{node}.log", "w") as log:
            cmd = ["ip", "netns", "exec", ns, "unshare", "--uts", "--mount", "sh", "-c", inner]
            procs.append(subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=child, start_new_session=True
            ))  # fmt: skip
    return procs


def kill_host(hosts: EmulatedHosts, node: int) -> None:
    """Lose host ``node``: SIGKILL everything running in its namespace (torchrun, its ranks)."""
    EmulatedHosts._kill_inside(hosts.hosts[node][0])


def _tails(paths: list[Path]) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in paths if p.exists())
