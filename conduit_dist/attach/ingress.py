"""A plane rank's ingress for producers outside the job (docs/attach.md).

The job's world is fixed by ``torchrun``; a generator started later, on another machine, or
restarted after a crash cannot join its process group. It attaches to an ingress instead: a
TCP endpoint one plane rank opens (``open_ingress``), published in a file under a run directory
(``ingress-rank<r>.json``). Over one connection per producer (frames of ``attach/frames.py``:
JSON headers and raw tensor bytes, no pickle) it gets the plane's spec and policy version,
``put``s, pulls weights and leaves. Its data enters the plane through the ingress rank's shard
(the same checked ``put`` a rank's own producer makes) and from there follows every sampler,
placement and pacing rule, through the job's own collectives.

Threads: one accepts connections; one per connection reads frames and queues them. Everything
that touches the plane runs on the plane's own thread in :meth:`Ingress.drain`, which the plane
calls before each round (and ``flush``/``fetch``): puts are stored, then acknowledged; pulls are
answered with the current weights (sent by a short-lived thread, so a large model never blocks
the learner). A put is acknowledged once the shard holds it, and only then (``Account``).

Exactly once: each producer numbers its puts; the ingress remembers the last it stored, so a put
received again (a reattach after a lost connection re-sends what was not acknowledged) is
acknowledged without being stored twice. A producer that falls silent for ``timeout_s`` (no
frame, no heartbeat) or whose connection breaks (a SIGKILL closes its socket at once) is
``disconnected``; if it does not reattach within ``grace_s`` it is ``dead``: its groups still
incomplete on this shard are dropped and counted by id; what it put complete and acknowledged
stays and is delivered as any other group. Learners never wait for it: a round never waits for
a producer outside the job.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from conduit_dist.attach import frames
from conduit_dist.attach.ledger import Account, merge, totals
from conduit_dist.errors import ConfigError
from conduit_dist.threads import start_thread

log = logging.getLogger("conduit_dist")
REFUSALS_KEPT = 256  # refused puts remembered per producer (answered again if re-sent)


class Retry(Exception):
    """Raised by a target whose plane cannot take a put now (e.g. a round in flight under
    ``max_lag=0``): the put stays queued, in order, for the next drain."""


class Target(Protocol):
    """What an ingress needs of its plane (``tokens/attached.py``, ``plane/attached.py``)."""

    kind: str  # "tokens" or "rows"
    rank: int

    def describe(self) -> dict:
        """The plane's spec as JSON (what a producer must put)."""

    def version(self) -> int:
        """The policy version producers should generate with now."""

    def store(self, tensors: dict[str, torch.Tensor], version: int | None) -> tuple[int, list]:
        """Store one put whole on this rank's shard (the plane's own checks): returns its item
        count and group ids; raises ``SpecError``/``ConfigError`` with nothing stored."""

    def incomplete(self, gids: list[int]) -> list[int]:
        """Of ``gids``, those still incomplete on this shard."""

    def drop(self, gids: list[int]) -> None:
        """Remove incomplete groups from this shard."""

    def holds(self, gid: int) -> bool:
        """Whether group ``gid`` is still on this shard (delivered or evicted ones are not)."""

    def weights(self) -> tuple[int, torch.Tensor | None]:
        """The latest published weights buffer (self-describing, flow/weights.py) and its
        version."""


def advertised_host() -> str:
    """The address peers reach this host by: ``CONDUIT_ADVERTISE_HOST`` if set, else the
    interface that routes to ``MASTER_ADDR`` (torchrun's rendezvous host; ``127.0.0.1`` on one
    host), else this host's name."""
    if os.environ.get("CONDUIT_ADVERTISE_HOST"):
        return os.environ["CONDUIT_ADVERTISE_HOST"]
    master = os.environ.get("MASTER_ADDR", "")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, 1))  # no packet is sent: the route is chosen
                return s.getsockname()[0]
        except OSError:
            pass
    return socket.gethostname()


@dataclass
class _Conn:
    """One producer's current connection; frames to it go through ``out`` to its writer
    thread, so neither the plane's thread nor a reader ever blocks on a slow producer."""

    id: int
    producer: str
    sock: socket.socket
    out: queue.Queue


class Ingress:
    """A TCP endpoint on one plane rank through which attached producers put (module docstring).

    Args:
        target: the plane's side (``Target``).
        host: the address to listen on (default all interfaces).
        port: the port (0: any free one).
        advertise: the address written in the endpoint (default :func:`advertised_host`).
        run_dir: where ``ingress-rank<r>.json`` is written (``None``: no file; the endpoint is
            :attr:`endpoint`).
        timeout_s: a connection silent this long is lost (producers beat every quarter of it);
            a frame to a producer not sent within it drops the connection.
        grace_s: a lost producer that has not reattached after this long is dead (default
            ``timeout_s``).
        window: puts a producer may have unacknowledged (its ``put`` waits beyond).

    Raises:
        ConfigError: on a bad value, or when the port cannot be bound.
    """

    def __init__(
        self,
        target: Target,
        *,
        host: str = "0.0.0.0",
        port: int = 0,
        advertise: str | None = None,
        run_dir: str | None = None,
        timeout_s: float = 60.0,
        grace_s: float | None = None,
        window: int = 64,
    ) -> None:
        for name, v in (("timeout_s", timeout_s), ("grace_s", grace_s)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
                raise ConfigError(f"ingress {name}: expected a number > 0, got {v!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ConfigError(f"ingress window: expected an int >= 1, got {window!r}")
        self.target, self.timeout_s, self.window = target, float(timeout_s), window
        self.grace_s = float(timeout_s if grace_s is None else grace_s)
        try:
            self._server = socket.create_server((host, port), backlog=64)
        except OSError as exc:
            raise ConfigError(
                f"ingress: rank {target.rank} could not listen on {host}:{port} ({exc.strerror})"
            ) from exc
        self.port = self._server.getsockname()[1]
        self.endpoint = f"{advertise or advertised_host()}:{self.port}"
        self.accounts: dict[str, Account] = {}
        self._refused: dict[str, dict[int, str]] = {}  # producer -> recent refusals by seq
        self._conns: dict[str, _Conn] = {}
        self._socks: set[socket.socket] = set()  # every open connection, registered or not
        self._socks_lock = threading.Lock()
        self._lost_at: dict[str, float] = {}  # disconnected producer -> when
        self._origin: dict[int, str] = {}  # group id on this shard -> its attached producer
        self._events: queue.Queue = queue.Queue()
        self._deferred: list[tuple] = []  # puts a target could not take yet (Retry), in order
        self._ids = itertools.count(1)
        self._drains = 0
        self._closed = threading.Event()
        self._weights: tuple[int, torch.Tensor] | None = None  # one host copy per version
        self.path = None
        if run_dir is not None:
            self.path = self._publish(run_dir)
        # host sockets only: no CUDA device to set in any of the ingress's threads
        self._accepting = start_thread(self._accept, f"conduit-ingress-{target.rank}", None)

    # ------------------------------------------------------------------ threads

    def _publish(self, run_dir: str) -> str:
        """Write the endpoint file atomically (a producer never reads half of it)."""
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, f"ingress-rank{self.target.rank}.json")
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(
                {"endpoint": self.endpoint, "rank": self.target.rank, "kind": self.target.kind,
                 "pid": os.getpid()}, f,
            )  # fmt: skip
        os.replace(tmp, path)
        return path

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._server.accept()
            except OSError:  # closed
                return
            with self._socks_lock:
                if self._closed.is_set():
                    _close(sock)
                    return
                self._socks.add(sock)
            start_thread(lambda sock=sock: self._serve(sock), "conduit-ingress-read", None)

    def _serve(self, sock: socket.socket) -> None:
        """One connection: the hello, then frames until it ends (events for :meth:`drain`)."""
        sock.settimeout(self.timeout_s)  # reads (beats come 4x as often) and the writer's sends
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = None
        try:
            head, _ = frames.receive(sock)
            conn = self._hello(sock, head)
            while not self._closed.is_set():
                head, tensors = frames.receive(sock)
                op = head.get("op")
                if op == "version":  # what the plane's version is now (reserve's wait)
                    self._send(conn, {"op": "version", "current": self.target.version()})
                elif op in ("put", "pull", "bye"):
                    self._events.put((op, conn, head, tensors))
                    if op == "bye":
                        return
                elif op != "beat":
                    raise frames.FrameError(f"unknown op {op!r}")
        except Exception as exc:  # a broken, silent or malformed peer: its connection ends
            if conn is not None and not self._closed.is_set():
                self._events.put(("lost", conn, {"why": f"{type(exc).__name__}: {exc}"}, None))
            elif conn is None and not self._closed.is_set():
                log.warning("ingress rank %d: a connection failed its hello (%s)",
                            self.target.rank, exc)  # fmt: skip
        finally:
            if conn is None or self._closed.is_set():
                self._forget(sock)

    def _forget(self, sock: socket.socket) -> None:
        with self._socks_lock:
            self._socks.discard(sock)
        _close(sock)

    def _hello(self, sock: socket.socket, head: dict) -> _Conn:
        """Register a producer (new, or reattaching by its id) and welcome it."""
        if head.get("op") != "hello" or head.get("kind") != self.target.kind:
            raise ConfigError(
                f"ingress rank {self.target.rank}: expected hello for a {self.target.kind} "
                f"plane, got op={head.get('op')!r} kind={head.get('kind')!r}"
            )
        asked = head.get("producer")
        pid = str(asked) if asked else f"r{self.target.rank}-p{next(self._ids)}"
        conn = _Conn(next(self._ids), pid, sock, queue.Queue())
        start_thread(lambda: self._write(conn), "conduit-ingress-write", None)
        self._events.put(("hello", conn, head, None))
        acct = self.accounts.get(pid)
        self._send(conn, {
            "op": "welcome", "producer": pid, "acked": acct.last_seq if acct else 0,
            "refused": {str(k): v for k, v in self._refused.get(pid, {}).items()},
            "spec": self.target.describe(), "version": self.target.version(),
            "rank": self.target.rank, "timeout_s": self.timeout_s, "window": self.window,
        })  # fmt: skip
        return conn

    def _send(self, conn: _Conn, header: dict, tensors=None) -> None:
        """Queue one frame for ``conn``'s writer (never blocks)."""
        conn.out.put(frames.encode(header, tensors))

    def _write(self, conn: _Conn) -> None:
        """``conn``'s writer: its frames in order; a send that fails or outlasts ``timeout_s``
        ends the connection (its reader then reports it lost)."""
        while True:
            frame = conn.out.get()
            if frame is None:
                return
            try:
                frames.send(conn.sock, frame)
            except OSError:
                _close(conn.sock)
                return

    # ------------------------------------------------------------------ the plane's thread

    def drain(self) -> int:
        """Apply what producers sent since the last call (the plane's thread, before a round,
        with no round in flight): store and acknowledge puts, answer pulls, register arrivals
        and departures, and declare dead those lost for longer than ``grace_s``. Returns the
        puts stored. Nothing once closed."""
        if self._closed.is_set():
            return 0
        stored = 0
        events, self._deferred = self._deferred, []
        while True:
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                break
        for ev, conn, head, tensors in events:
            current = self._conns.get(conn.producer)
            if ev == "hello":
                try:
                    through = int(head.get("acked_through", 0))
                except (TypeError, ValueError):
                    through = 0
                self._arrive(conn, through)
            elif current is None or current.id != conn.id:
                continue  # a replaced connection's leftovers
            elif any(d[1].id == conn.id for d in self._deferred):
                self._deferred.append((ev, conn, head, tensors))  # its order kept
            elif ev == "put":
                stored += self._put(conn, head, tensors)
            elif ev == "pull":
                self._pull(conn, head)
            elif ev == "bye":
                self._leave(conn.producer, "closed", "closed with the group incomplete")
            elif ev == "lost":
                self._lost(conn, head["why"])
        now = time.monotonic()
        for pid, at in list(self._lost_at.items()):
            if now - at > self.grace_s:
                self._leave(pid, "dead", f"lost and not back within grace_s={self.grace_s:g}")
        self._drains += 1
        if self._drains % 64 == 0:  # groups evicted meanwhile are no one's any more
            for g in [g for g in self._origin if not self.target.holds(g)]:
                del self._origin[g]
        return stored

    def _arrive(self, conn: _Conn, acked_through: int) -> None:
        pid = conn.producer
        old = self._conns.get(pid)
        if old is not None:  # a reattach while the old connection looked alive: replace it
            self._end(old)
        self._conns[pid] = conn
        self._lost_at.pop(pid, None)
        known = pid in self.accounts
        acct = self.accounts.setdefault(pid, Account(pid))
        if acked_through > acct.last_seq and known:  # acknowledged after the checkpoint
            lost = acked_through - acct.last_seq
            acct.lost += lost
            acct.lost_why = (
                f"puts {acct.last_seq + 1}..{acked_through} were acknowledged after the "
                "checkpoint this job was restored from and died with the job before it"
            )
            log.warning("ingress rank %d: producer %s: %d acknowledged put(s) lost (%s)",
                        self.target.rank, pid, lost, acct.lost_why)  # fmt: skip
        elif acked_through > acct.last_seq:  # an earlier job's, whose ledger this one lacks
            acct.unknown += acked_through - acct.last_seq
            log.warning(
                "ingress rank %d: producer %s had %d put(s) acknowledged by an earlier job "
                "whose ledger this job did not restore: delivered or lost, it cannot tell",
                self.target.rank, pid, acked_through - acct.last_seq,
            )  # fmt: skip
        acct.last_seq = max(acct.last_seq, acked_through)  # numbering goes on after them
        acct.state, acct.attaches = "live", acct.attaches + 1
        log.info("ingress rank %d: producer %s attached (%d time(s))",
                 self.target.rank, pid, acct.attaches)  # fmt: skip

    def _end(self, conn: _Conn) -> None:
        """Close a connection: its writer stops after what is queued, its socket closes."""
        conn.out.put(None)
        self._forget(conn.sock)

    def _put(self, conn: _Conn, head: dict, tensors: dict[str, torch.Tensor]) -> int:
        acct = self.accounts[conn.producer]
        refused = self._refused.setdefault(conn.producer, {})
        try:
            seq = int(head["seq"])
            version = None if head.get("version") is None else int(head["version"])
        except (KeyError, TypeError, ValueError):
            self._lost(conn, f"a malformed put header {head}")
            return 0
        if seq in refused:  # re-sent after a lost refusal: refused again, never stored
            self._send(conn, {"op": "refused", "seq": seq, "type": "SpecError",
                              "error": refused[seq]})  # fmt: skip
            return 0
        if seq <= acct.last_seq:  # sent again after a reattach: stored once already
            acct.duplicates += 1
            self._send(conn, {"op": "ack", "seq": seq, "version": self.target.version()})
            return 0
        if seq != acct.last_seq + 1:
            self._send(
                conn,
                {
                    "op": "refused",
                    "seq": seq,
                    "type": "ConfigError",
                    "error": f"put {seq} arrived after {acct.last_seq}: puts must "
                    "arrive in order (reattach re-sends from the last acknowledged)",
                },
            )
            self._lost(conn, f"put {seq} out of order")  # fmt: skip
            return 0
        try:
            items, gids = self.target.store(tensors, version)
        except Retry:  # the plane cannot take it now: kept, in order, for the next drain
            self._deferred.append(("put", conn, head, tensors))
            return 0
        except (ConfigError, ValueError, TypeError) as exc:  # refused whole: nothing stored
            acct.put += 1
            acct.refused += 1
            acct.last_seq = seq  # answered: numbering goes on after it
            refused[seq] = f"{type(exc).__name__}: {exc}"
            while len(refused) > REFUSALS_KEPT:
                del refused[next(iter(refused))]
            self._send(conn, {"op": "refused", "seq": seq, "type": type(exc).__name__,
                              "error": str(exc)})  # fmt: skip
            return 0
        acct.put += 1
        acct.acked += 1
        acct.items += items
        for g in gids:
            if g not in self._origin:
                acct.groups += 1
                self._origin[g] = conn.producer
        acct.last_seq = seq
        self._send(conn, {"op": "ack", "seq": seq, "version": self.target.version()})
        return 1

    def _pull(self, conn: _Conn, head: dict) -> None:
        """Answer a pull: the newest weights if newer than the producer's, else none; always
        the plane's current version (a waiting producer learns of a new one this way)."""
        version, buf = self.target.weights()
        current = self.target.version()
        try:
            have = int(head.get("have", 0))
        except (TypeError, ValueError):
            have = 0
        if buf is None or version <= have:
            self._send(conn, {"op": "weights", "version": have, "current": current})
            return
        if self._weights is None or self._weights[0] != version:  # one host copy per version
            self._weights = (version, buf.detach().to("cpu", copy=True).contiguous())
        self._send(conn, {"op": "weights", "version": version, "current": current},
                   {"buf": self._weights[1]})  # fmt: skip

    def _lost(self, conn: _Conn, why: str) -> None:
        pid = conn.producer
        self._end(conn)
        acct = self.accounts[pid]
        if acct.state == "live":
            acct.state = "disconnected"
            self._lost_at[pid] = time.monotonic()
            log.warning("ingress rank %d: producer %s lost (%s); dead unless it reattaches "
                        "within %gs", self.target.rank, pid, why, self.grace_s)  # fmt: skip

    def _leave(self, pid: str, state: str, why: str) -> None:
        """A producer gone for good: its incomplete groups on this shard dropped, by id."""
        conn = self._conns.pop(pid, None)
        if conn is not None:
            self._end(conn)
        self._lost_at.pop(pid, None)
        self._deferred = [d for d in self._deferred if d[1].producer != pid]
        acct = self.accounts[pid]
        acct.state = state
        mine = [g for g, p in self._origin.items() if p == pid]
        gone = self.target.incomplete(mine)
        if gone:
            self.target.drop(gone)
            for g in gone:
                self._origin.pop(g, None)
            acct.dropped += gone
            acct.dropped_why = why
        log.log(logging.WARNING if state == "dead" else logging.INFO,
                "ingress rank %d: producer %s %s; %d incomplete group(s) dropped %s",
                self.target.rank, pid, state, len(gone), gone[:16])  # fmt: skip

    def delivered(self, gids: list[int], removed: bool) -> None:
        """Count deliveries of attached producers' groups (the plane's round, on this holder;
        never while :meth:`drain` runs); ``removed``: they left the shard (consumed once)."""
        for g in gids:
            pid = self._origin.get(g)
            if pid is not None:
                self.accounts[pid].delivered += 1
                if removed:
                    del self._origin[g]

    def state_dict(self) -> dict[str, dict[str, object]]:
        """The ledger, for the plane's checkpoint (plain values: loads with
        ``weights_only=True``)."""
        return self.ledger()

    def restore(self, states: list[dict[str, dict]]) -> None:
        """Take the ledger of a checkpoint (every old rank's, merged): a producer that
        reattaches is told its last put stored as of then; what it had acknowledged since is
        counted lost (``Account.lost``)."""
        self.accounts = merge(states)

    def ledger(self) -> dict[str, dict[str, object]]:
        """Every producer that attached here: its :class:`Account` as a dict."""
        return {pid: a.as_dict() for pid, a in self.accounts.items()}

    def totals(self) -> dict[str, int]:
        """The ledger summed over producers (flat numbers for metrics)."""
        return totals(list(self.accounts.values()))

    def close(self) -> None:
        """Stop accepting, tell every registered producer the plane closed, close every
        connection (registered or not) and drop the endpoint file. Later drains do nothing."""
        if self._closed.is_set():
            return
        self._closed.set()
        _close(self._server)
        told = list(self._conns.values())
        for conn in told:
            self._send(conn, {"op": "closed", "rank": self.target.rank})
            conn.out.put(None)
        self._conns.clear()
        deadline = time.monotonic() + 1.0  # the writers' last frames, briefly
        while time.monotonic() < deadline and any(not c.out.empty() for c in told):
            time.sleep(0.01)
        with self._socks_lock:
            socks, self._socks = list(self._socks), set()
        for sock in socks:
            _close(sock)
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def open_for(
    current: Ingress | None,
    target: Target,
    world: int,
    plane_timeout_s: float,
    run_dir: str | None,
    timeout_s: float | None,
    **options,
) -> Ingress:
    """What both planes' ``open_ingress`` do: refuse a second ingress on a rank, remove a larger
    earlier job's endpoint files (rank 0), and open this rank's (``timeout_s``: the plane's
    collective timeout by default; ``options``: :class:`Ingress`'s others).

    Raises:
        ConfigError: if ``current`` is open already, or as :class:`Ingress`.
    """
    if current is not None:
        raise ConfigError(f"open_ingress: rank {target.rank} has one open at {current.endpoint}")
    if run_dir is not None and target.rank == 0:
        stale_ingress_files(run_dir, world)
    timeout = plane_timeout_s if timeout_s is None else timeout_s
    return Ingress(target, run_dir=run_dir, timeout_s=timeout, **options)


def stale_ingress_files(run_dir: str, world: int) -> list[str]:
    """Remove ``ingress-rank<r>.json`` files of ranks ``>= world`` under ``run_dir`` (an
    earlier, larger job's: a producer must not try them); returns what was removed."""
    gone = []
    if not os.path.isdir(run_dir):
        return gone
    for name in os.listdir(run_dir):
        if name.startswith("ingress-rank") and name.endswith(".json"):
            r = name[len("ingress-rank") : -len(".json")]
            if r.isdigit() and int(r) >= world:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(run_dir, name))
                gone.append(name)
    return gone


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
