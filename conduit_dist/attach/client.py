"""A producer outside the job (docs/attach.md): ``cd.attach(run_dir)`` connects to a plane's
ingress and gives an :class:`AttachedProducer` that ``put``s, pulls weights and closes.

Puts are numbered and kept until the ingress acknowledges them (a shard holds them). A lost
connection is re-established on the next call (``reattach``, under the same producer id), and
only the puts not acknowledged are sent again; the ingress stores none twice. At most
``window`` puts are in flight: ``put`` waits for acknowledgements beyond. A put the plane
refuses (a ``SpecError`` naming the field) is raised by the next call.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import socket
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Mapping

import torch
from torch import nn

from conduit_dist.attach import frames
from conduit_dist.errors import ConfigError, RoundError, SpecError
from conduit_dist.flow.weights import WeightsState
from conduit_dist.threads import start_thread

KINDS = ("tokens", "rows")


def endpoints(where: str) -> list[tuple[str, int]]:
    """The ingress endpoints ``where`` names: ``host:port``, an ``ingress-rank<r>.json`` file,
    or a run directory holding such files (by rank).

    Raises:
        ConfigError: when ``where`` names none.
    """
    if os.path.isdir(where):
        files = sorted(
            glob.glob(os.path.join(where, "ingress-rank*.json")),
            key=lambda p: int(p.rsplit("rank", 1)[1].split(".")[0]),
        )
    elif os.path.isfile(where):
        files = [where]
    elif where.endswith(".json") or os.sep in where or not where.rpartition(":")[2].isdigit():
        raise ConfigError(f"attach: {where!r} does not exist yet (is the job up?)")
    else:
        host, _, port = where.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(
                f"attach: expected a run directory, an ingress-rank<r>.json file or host:port, "
                f"got {where!r}"
            )
        return [(host, int(port))]
    out = []
    for path in files:
        with open(path) as f:
            host, _, port = json.load(f)["endpoint"].rpartition(":")
        out.append((host, int(port)))
    if not out:
        raise ConfigError(f"attach: {where!r} holds no ingress-rank<r>.json (is the job up?)")
    return out


def attach(
    where: str,
    kind: str = "tokens",
    *,
    producer: str | None = None,
    ingress: int | None = None,
    timeout_s: float = 60.0,
) -> AttachedProducer:
    """Attach to a running plane's ingress.

    Args:
        where: a run directory (its ``ingress-rank<r>.json`` files), one such file, or
            ``host:port``.
        kind: ``"tokens"`` (a ``TokenPlane``: ragged groups) or ``"rows"`` (a ``DataPlane``).
        producer: this producer's id (``None``: the ingress names it). A connection lost and
            re-established by this process re-sends only what was not acknowledged. A new
            process under an id already used continues the numbering after the puts a shard
            holds (``resumed_from`` says how many; re-put only what came after them).
        ingress: which of the directory's endpoints (by position; default: one chosen by the
            producer id, so producers spread over the ranks that opened one).
        timeout_s: waiting for the run directory's endpoints, connecting, and waiting for
            acknowledgements give up after this long.

    Raises:
        ConfigError: on a bad argument or no endpoint; ConnectionError when none answers.
    """
    if kind not in KINDS:
        raise ConfigError(f"attach kind: expected one of {list(KINDS)}, got {kind!r}")
    deadline = time.monotonic() + timeout_s
    while True:  # a generator may start before the job has written its endpoints
        try:
            found = endpoints(where)
            break
        except (ConfigError, FileNotFoundError, json.JSONDecodeError):
            if ":" in os.path.basename(where) or time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    if ingress is None:
        ingress = zlib.crc32((producer or str(os.getpid())).encode()) % len(found)
    if not 0 <= ingress < len(found):
        raise ConfigError(f"attach ingress: expected 0..{len(found) - 1}, got {ingress}")
    return AttachedProducer(found[ingress], kind, producer, timeout_s, where, ingress)


class AttachedProducer:
    """One attached producer (made by :func:`attach`).

    Attributes:
        producer: its id at the ingress.
        spec: the plane's spec as the ingress described it.
        version: the newest policy version the ingress reported.
        rank: the ingress rank.
    """

    def __init__(
        self, address: tuple[str, int], kind: str, producer: str | None, timeout_s: float,
        where: str | None = None, index: int = 0,
    ) -> None:  # fmt: skip
        self.address, self.kind, self.timeout_s = address, kind, float(timeout_s)
        self.where, self.index = where, index  # re-read when the ingress is gone
        self._acked_hi = 0  # the newest put acknowledged (told to a restored ingress)
        self.producer, self.spec, self.version, self.rank = producer, {}, 0, -1
        self.window = 64
        self._seq = 0
        self._unacked: OrderedDict[int, list] = OrderedDict()  # seq -> frame, in order
        self._cv = threading.Condition()
        self._failures: list[Exception] = []  # refused puts, raised by the next call
        self._weights: tuple[int, torch.Tensor | None] | None = None
        self._sock: socket.socket | None = None
        self._send_lock = threading.Lock()
        self._broken = True
        self._closed = False
        self.resent = self.attaches = 0
        self._pulled = 0  # the newest weights version loaded
        self._started = 0  # groups reserved (reserve's pacing)
        self._version_seen = 0  # version answers received
        self.resumed_from = 0  # puts of an earlier process under this id that a shard holds
        self._connect()

    # ------------------------------------------------------------------ connection

    def _connect(self) -> None:
        """Connect (or reconnect) and re-send every put not acknowledged, in order."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                sock = socket.create_connection(self.address, timeout=min(self.timeout_s, 5))
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise ConnectionError(
                        f"attach: no ingress answered at {self.address[0]}:{self.address[1]} "
                        f"within {self.timeout_s:g}s ({exc})"
                    ) from exc
                time.sleep(0.2)
                self._resolve()  # a restarted job listens elsewhere
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        frames.send(sock, frames.encode({"op": "hello", "producer": self.producer,
                                         "kind": self.kind,
                                         "acked_through": self._acked_hi}))  # fmt: skip
        head, _ = frames.receive(sock)
        if head.get("op") != "welcome":
            sock.close()
            raise ConnectionError(f"attach: expected a welcome, got {head}")
        self.producer, self.spec = head["producer"], head["spec"]
        self.version, self.rank = int(head["version"]), int(head["rank"])
        self.window, beat = int(head["window"]), float(head["timeout_s"]) / 4
        acked = int(head["acked"])
        refused = {int(k): v for k, v in head.get("refused", {}).items()}
        sock.settimeout(None)  # reads block (the reader thread); sends time out:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(self.timeout_s))
        with self._cv:
            if self.attaches == 0 and self._seq == 0:  # a new process under a known id:
                self._seq = self.resumed_from = acked  # numbering goes on after its puts
            lost = [s for s in self._unacked if s in refused]
            if lost:  # refused while the refusal could not reach us
                self._failures.append(SpecError(
                    f"attached put {lost[0]} refused by ingress rank {self.rank}: "
                    f"{refused[lost[0]]}"
                ))  # fmt: skip
            for seq in [s for s in self._unacked if s <= acked]:
                del self._unacked[seq]
            pending = list(self._unacked.values())
            self._sock, self._broken = sock, False
            self._cv.notify_all()
        self.attaches += 1
        start_thread(lambda: self._read(sock), "conduit-attach-read", None)  # host sockets
        start_thread(lambda: self._beat(sock, beat), "conduit-attach-beat", None)
        for frame in pending:  # what the ingress may not hold: once more, in order
            self.resent += 1
            self._send(frame)

    def _resolve(self) -> None:
        """Re-read the run directory's endpoints (those a restarted job wrote) and pick this
        producer's again; the current address stays when none can be read."""
        if self.where is None:
            return
        try:
            found = endpoints(self.where)
        except (ConfigError, OSError, ValueError, KeyError):
            return
        self.address = found[self.index % len(found)]  # the same rank, or one of fewer

    def _send(self, frame: list) -> None:
        """Send on the current connection; a failed or timed-out send marks it broken."""
        with self._send_lock:
            sock = self._sock
            try:
                frames.send(sock, frame)
            except OSError:
                self._mark_broken(sock)

    def _mark_broken(self, sock) -> None:
        with self._cv:
            if self._sock is sock:
                self._broken = True
            self._cv.notify_all()

    def _read(self, sock: socket.socket) -> None:
        """Acknowledgements, refusals and weights from the ingress."""
        try:
            while True:
                head, tensors = frames.receive(sock)
                op = head.get("op")
                with self._cv:
                    if op == "ack":
                        self._unacked.pop(int(head["seq"]), None)
                        self._acked_hi = max(self._acked_hi, int(head["seq"]))
                        self.version = max(self.version, int(head.get("version", 0)))
                    elif op == "refused":
                        self._unacked.pop(int(head["seq"]), None)
                        kind = SpecError if head.get("type") == "SpecError" else ConfigError
                        self._failures.append(kind(
                            f"attached put {head['seq']} refused by ingress rank {self.rank}: "
                            f"{head.get('error')}"
                        ))  # fmt: skip
                    elif op == "version":
                        self.version = max(self.version, int(head.get("current", 0)))
                        self._version_seen += 1
                    elif op == "weights":
                        self._weights = (int(head["version"]), tensors.get("buf"))
                        self.version = max(self.version, int(head.get("current", 0)))
                    elif op == "closed":
                        self._failures.append(RoundError(
                            f"the plane closed (ingress rank {head.get('rank')}); stop putting",
                            round=-1,
                        ))  # fmt: skip
                        self._closed = True
                    self._cv.notify_all()
        except (OSError, frames.FrameError):
            self._mark_broken(sock)

    def _beat(self, sock: socket.socket, every: float) -> None:
        frame = frames.encode({"op": "beat"})
        while not self._closed and self._sock is sock and not self._broken:
            time.sleep(every)
            with self._send_lock:
                if self._sock is not sock:
                    return
                try:
                    frames.send(sock, frame)
                except OSError:
                    self._mark_broken(sock)
                    return

    def _ready(self) -> None:
        """Raise a failure the ingress reported; reconnect a broken connection."""
        with self._cv:
            failures, self._failures = self._failures, []
            broken = self._broken
        if failures:
            if len(failures) > 1:
                failures[0].add_note(f"and {len(failures) - 1} more refusal(s) since")
            raise failures[0]
        if self._closed:
            raise RoundError("the plane closed; stop putting", round=-1)
        if broken:
            self.reattach()

    def reattach(self) -> None:
        """Reconnect under the same producer id and re-send what was not acknowledged.

        Raises:
            ConnectionError: when no ingress answers within ``timeout_s``.
        """
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        self._connect()

    # ------------------------------------------------------------------ the producer's API

    def put(
        self,
        batch: Mapping[str, torch.Tensor],
        lengths: torch.Tensor | None = None,
        *,
        version: int | None = None,
    ) -> int:
        """Send one put (a ``TokenPlane.put``'s packed ragged fields with ``lengths``, or a
        ``DataPlane.put``'s rows); the ingress rank stores it whole or refuses it whole.

        Args:
            batch: ``name -> tensor`` as the plane's own ``put`` takes it.
            lengths: ``[B]`` sequence lengths (token planes).
            version: the policy version that generated it (default: the ingress's current).

        Returns:
            Its sequence number (acknowledged once a shard holds it: :meth:`flush`).

        Raises:
            SpecError / ConfigError: a refused earlier put, or a bad argument.
            ConnectionError: when the ingress cannot be reached again within ``timeout_s``.
        """
        if not isinstance(batch, Mapping) or not batch:
            raise ConfigError(f"put: expected a non-empty mapping of tensors, got {type(batch)}")
        tensors = {}
        for name, t in batch.items():
            if not isinstance(t, torch.Tensor) or t.is_nested:
                raise ConfigError(f"put: {name!r}: expected a (packed) tensor, got {type(t)}")
            tensors[name] = t
        if self.kind == "tokens":
            if lengths is None:
                raise ConfigError("put: a token plane's put needs lengths= ([B] sequence lengths)")
            tensors["__lengths__"] = torch.as_tensor(lengths)
        elif lengths is not None:
            raise ConfigError("put: lengths= is for token planes; a row plane's put has none")
        self._ready()
        with self._cv:  # at most `window` in flight
            self._wait(lambda: len(self._unacked) < self.window, "an acknowledgement")
            self._seq += 1
            seq = self._seq
            frame = frames.encode({"op": "put", "seq": seq, "version": version}, tensors)
            self._unacked[seq] = frame
        self._send(frame)
        return seq

    def _wait(self, done, what: str) -> None:
        """Wait on the condition (held) until ``done()``; a broken connection reattaches."""
        deadline = time.monotonic() + self.timeout_s
        while not done():
            if self._failures or self._closed:
                return
            if self._broken:
                self._cv.release()
                try:
                    self.reattach()
                finally:
                    self._cv.acquire()
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"attached producer {self.producer}: no {what} from ingress rank {self.rank} "
                    f"within {self.timeout_s:g}s ({len(self._unacked)} put(s) unacknowledged)"
                )
            self._cv.wait(min(left, 0.5))

    def flush(self) -> None:
        """Wait until every put is acknowledged (held by a shard).

        Raises:
            SpecError / ConfigError: a refused put; TimeoutError after ``timeout_s``.
        """
        with self._cv:
            self._wait(lambda: not self._unacked, "acknowledgement of every put")
        self._ready()

    @property
    def unacked(self) -> int:
        """Puts sent and not acknowledged yet."""
        return len(self._unacked)

    def pull_weights(self, model: nn.Module) -> int:
        """Load the plane's newest published weights into ``model`` when newer than the last
        pulled (names, shapes and dtypes checked first, flow/weights.py).

        Returns:
            The version loaded (or held already; 0: none published).

        Raises:
            SpecError: on weights that do not match ``model``; TimeoutError after
            ``timeout_s``.
        """
        self._ready()
        have = self._pulled
        deadline = time.monotonic() + self.timeout_s
        while True:  # a pull lost with a broken connection is sent again on the new one
            with self._cv:
                self._weights, attach = None, self.attaches
            self._send(frames.encode({"op": "pull", "have": have}))
            with self._cv:
                while (self._weights is None and self.attaches == attach and not self._broken
                       and not self._failures and not self._closed
                       and time.monotonic() < deadline):  # fmt: skip
                    self._cv.wait(0.1)
                got = self._weights
            if got is not None:
                break
            self._ready()  # a refusal or the plane's close raises; a broken one reattaches
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"attached producer {self.producer}: no weights from ingress rank "
                    f"{self.rank} within {self.timeout_s:g}s"
                )
        version, buf = got
        if buf is not None and version > have:
            ws = WeightsState()
            ws.hold(version, buf)
            ws.pull(model)
            self._pulled = version
        return max(version, have)

    def _pacing(self) -> tuple[int | None, int | None]:
        pacing = self.spec.get("pacing") or {}
        return pacing.get("per_version"), pacing.get("max_age")

    def allowance(self) -> int | None:
        """Groups :meth:`reserve` grants now without waiting (``None``: not paced): at most
        ``per_version`` groups a learner version, ``max_age + 1`` versions ahead, as the
        ingress rank's plane set them (``TokenPlane.open_ingress``)."""
        per, age = self._pacing()
        if per is None or age is None:
            return None
        return max(0, (self.version + age + 1) * per - self._started)

    def reserve(self, n: int, model: nn.Module | None = None) -> int:
        """Ask before generating ``n`` groups: waits while they could come out older than the
        plane's ``max_policy_age`` by the time they are used (never dropped for age then).

        Args:
            n: groups about to be generated.
            model: pulled to the newest weights first (and while waiting).

        Returns:
            The policy version to generate with (``put(..., version=)``).

        Raises:
            ConfigError: ``n`` < 1 or more than one version's worth; RoundError once the plane
                closed; TimeoutError when no version comes within ``timeout_s``.
        """
        per = self._pacing()[0]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"reserve: expected a group count >= 1, got {n!r}")
        if per is not None and n > per:
            raise ConfigError(
                f"reserve: {n} groups exceed what one version grants ({per}, "
                "groups_per_version): reserve at most that many at a time"
            )
        deadline = time.monotonic() + self.timeout_s
        while True:
            if model is not None:
                self.pull_weights(model)
            left = self.allowance()
            if left is None or left >= n:
                self._started += n
                return self._pulled if model is not None else self.version
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"reserve: no new policy version from ingress rank {self.rank} within "
                    f"{self.timeout_s:g}s ({self._started} groups started, version {self.version})"
                )
            time.sleep(0.05)
            if model is None:
                self._ask_version()

    def _ask_version(self) -> None:
        """The plane's current version, asked and waited for (one answer)."""
        self._ready()
        with self._cv:
            seen = self._version_seen
        self._send(frames.encode({"op": "version"}))
        with self._cv:
            end = time.monotonic() + min(self.timeout_s, 5.0)
            while self._version_seen == seen and not self._broken and time.monotonic() < end:
                self._cv.wait(0.1)

    def close(self) -> None:
        """Wait for every acknowledgement, then leave cleanly (the ingress drops this
        producer's incomplete groups, counted, at once instead of after its grace)."""
        if self._sock is None:
            return
        try:
            if not self._closed:
                self.flush()
                self._send(frames.encode({"op": "bye"}))
        finally:
            self._closed = True
            sock, self._sock = self._sock, None
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> AttachedProducer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _timeval(seconds: float) -> bytes:
    """``struct timeval`` for ``SO_SNDTIMEO``."""
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))
