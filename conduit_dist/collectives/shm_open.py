"""Start-up of the shared-memory transport (``collectives/shm.py``): every rank of a plane agrees
``transport.shared_memory`` (``"auto"``, ``True`` or ``False``), rank 0 makes the control block
of the barrier, every rank maps and locks it, and ``"auto"`` decides, the same on every rank,
whether the transport is on."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import socket

import torch
import torch.distributed as dist

from conduit_dist.collectives.shm import (
    _ALIGN,
    _SLOT,
    SHM_DIR,
    SharedMemory,
    _map,
    create,
    half_bytes,
    header_bytes,
)
from conduit_dist.errors import ConfigError
from conduit_dist.records.native import _native

log = logging.getLogger("conduit_dist")

MARGIN = 64 << 20
"""Bytes of ``/dev/shm`` left to others beyond what the ranks need at start-up (NCCL's
intra-node buffers, data loader workers' tensors)."""

_CODES = {False: 1, True: 2, "auto": 3}  # a rank's setting in the agreement (0: not heard)


def native_barrier() -> bool:
    """Whether the native extension has the barrier and the batched copies of an exchange (a
    build older than them does not)."""
    return _native is not None and all(
        hasattr(_native, f) for f in ("shm_wait", "shm_arrive", "shm_lock", "copy_spans")
    )


def open_shared(ex, wanted: bool | str) -> SharedMemory | None:
    """Agree ``transport.shared_memory`` (``wanted``: ``True``, ``False`` or ``"auto"``) over
    ``ex``'s group and return this rank's :class:`SharedMemory`, or ``None`` where it is off.
    Collective: every rank calls it at the same point, whatever it wants, and every rank takes
    the same decision from what all of them reported.

    ``True`` checks that every rank sees rank 0's ``/dev/shm``; ``"auto"`` turns it on only
    where every rank does, all are on one host by the topology's host keys
    (``topology.host_key``: emulated hosts sharing one ``/dev/shm`` stay apart), every rank's
    native extension has the barrier and ``/dev/shm`` has room for what all its ranks map at
    start-up (:func:`room_for`), and otherwise says why once (rank 0, ``WARNING``).

    Raises:
        ConfigError: naming the ranks whose setting differs from the others'; with ``True``, the
            ranks that do not see rank 0's ``/dev/shm`` (another host, another container or
            user), or whose native extension lacks the barrier, or a ``/dev/shm`` without room
            (naming the bytes needed and free).
    """
    # [rank]: the setting's code; [world + rank]: 1 where the native barrier is there
    asked = torch.zeros(2 * ex.world, dtype=torch.int64)
    asked[ex.rank] = _CODES[wanted]
    asked[ex.world + ex.rank] = int(native_barrier())
    ex.run(lambda: dist.all_reduce(asked, group=ex.group, async_op=True), "shm setting")
    got = asked.tolist()
    codes, native = got[: ex.world], got[ex.world :]
    if len(set(codes)) > 1:
        names = {c: w for w, c in _CODES.items()}
        said = ", ".join(
            f"ranks {[r for r, c in enumerate(codes) if c == code]} set {names[code]!r}"
            for code in sorted(set(codes))
        )
        raise ConfigError(f"transport.shared_memory: {said}; expected the same on every rank")
    agreed = {c: w for w, c in _CODES.items()}[codes[0]]  # not this rank's value: 0 == False
    if agreed is False:
        return None
    auto = agreed == "auto"
    bare = [r for r, n in enumerate(native) if not n]
    if bare:
        why = (
            f"ranks {bare} lack the native barrier (conduit_dist._native._pack not built, or "
            "built before it: pip install -e .)"
        )
        if auto:
            return _off(ex, why)
        raise ConfigError(f"transport.shared_memory: {why}; expected it on every rank")
    token = torch.zeros(2, dtype=torch.int64)  # [token, whether rank 0 made the control file]
    why, made = "", ""  # made: rank 0's control file, unlinked below whatever happens
    if ex.rank == 0:
        token[0] = secrets.randbits(62)
        path = _control_path(f"{int(token[0]):016x}")
        try:  # zeros: no rank arrived anywhere
            os.close(create(path, ex.world * _SLOT))
            made, token[1] = path, 1
        except OSError as exc:
            why = f" ({exc.strerror})"
    try:
        return _decide(ex, auto, token, why)
    finally:
        if made:  # every rank that sees it has mapped and locked it by now (or failed)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(made)


def _decide(ex, auto: bool, token: torch.Tensor, why: str) -> SharedMemory | None:
    """The rest of :func:`open_shared`, from the token's broadcast on: every rank maps and locks
    the control file, reports what it sees, and all decide alike."""
    ex.run(lambda: dist.broadcast(token, 0, group=ex.group, async_op=True), "shm token")
    if not int(token[1]):
        if auto:
            return _off(ex, f"rank 0 could not create a file in {SHM_DIR}")
        raise ConfigError(
            f"transport.shared_memory: rank 0 could not create a file in {SHM_DIR}{why}; set "
            "shared_memory=False where there is no shared /dev/shm"
        )
    name = f"{int(token[0]):016x}"
    control, unseen, why = None, "", None
    try:
        try:
            control = _open_control(_control_path(name), ex.rank, ex.world)
        except OSError as exc:  # another host or container, another user: named below
            unseen = f"; this rank: {exc.strerror}"
        flags, bad_key = _probe(ex, control is not None)
        why = _judge(ex.world, auto, flags, bad_key, unseen)
    finally:
        if why != "" and control is not None:  # off or failed: its lock and mapping go
            os.close(control[0])
    if why:
        return _off(ex, why)
    return SharedMemory(ex.rank, ex.world, name, control, ex.timeout)


def _judge(w: int, auto: bool, flags: list[int], bad_key: str, unseen: str) -> str:
    """From every rank's report (:func:`_probe`): why ``"auto"`` is off (``""``: on).

    Raises:
        ConfigError: the same on every rank: ranks with a malformed node index variable; with
            ``True``, ranks that do not see rank 0's ``/dev/shm``.
    """
    missing = [r for r in range(w) if not flags[r]]
    keys = flags[2 * w :]
    # every rank sees rank 0's /dev/shm where it is used: all w ranks share it
    short = room_for(min(flags[w : 2 * w]), w, startup_bytes(w))
    malformed = [r for r in range(w) if keys[r] < 0]
    if malformed:  # the same error on every rank, not one raising and the rest timing out
        raise ConfigError(
            f"ranks {malformed}: their node index variable is malformed "
            f"({bad_key or 'their own error says how'}); it tells hosts apart"
        )
    if missing and not auto:
        raise ConfigError(
            f"transport.shared_memory: ranks {missing} do not see rank 0's {SHM_DIR} (another "
            f"host, a container with its own, or another user{unseen}); set "
            "shared_memory=False for planes across hosts"
        )
    if not auto:
        if short:
            raise ConfigError(
                f"transport.shared_memory: {short}; make {SHM_DIR} larger (docker: "
                "--shm-size) or set shared_memory=False"
            )
        return ""
    apart = [r for r in range(w) if keys[r] != keys[0]]
    if missing:
        return f"ranks {missing} do not see rank 0's {SHM_DIR} (several hosts or containers)"
    if apart:
        return f"ranks {apart} are on other hosts than rank 0 (topology host keys)"
    return short


def startup_bytes(world: int) -> int:
    """Bytes of ``/dev/shm`` one rank of ``world`` holds at most during start-up: calibration's
    largest probe (``model.calibration``: each rank sends ``max(PROBE_SIZES)`` bytes to each
    of its ``world - 1`` peers through shared memory in the uniform pattern) in the two halves
    of its file, while the generation before it is still mapped by the peers (a new file is
    made, at the exchange that needs it, before they map it and let go of the old one).

    Args:
        world: the ranks of the plane.

    Returns:
        The bytes of the largest two generations of one rank's file, as :meth:`SharedMemory.start`
        grows them through the probe sizes.
    """
    from conduit_dist.collectives.model.calibration import PROBE_SIZES  # (imports exchange)

    cap = peak = 0
    for size in sorted(PROBE_SIZES):
        need = header_bytes(world) + (world - 1) * (-(-size // _ALIGN) * _ALIGN)
        if need > cap:
            old, cap = cap, half_bytes(need, cap)
            peak = max(peak, 2 * (cap + old))
    return peak


def room_for(free: int, ranks: int, per_rank: int) -> str:
    """Whether ``/dev/shm`` can hold what its ranks map at start-up: ``ranks`` times
    ``per_rank`` plus :data:`MARGIN`.

    Args:
        free: bytes free in ``/dev/shm`` (the least any rank saw).
        ranks: the ranks sharing it (the plane's: every rank sees rank 0's where it is used).
        per_rank: what one rank maps at most (:func:`startup_bytes`).

    Returns:
        ``""`` where it fits, else why not, naming the bytes needed and free.

    Example::

        room_for(1 << 30, 8, startup_bytes(8))  # "/dev/shm has 1024.0 MiB free, ..."
    """
    need = ranks * per_rank + MARGIN
    if free >= need:
        return ""
    return (
        f"{SHM_DIR} has {free / 2**20:.1f} MiB free, less than the {need / 2**20:.1f} MiB its "
        f"{ranks} ranks need at start-up ({ranks} x {per_rank / 2**20:.1f} MiB, calibration's "
        f"largest probe in two generations of a rank's file, + {MARGIN >> 20} MiB margin)"
    )


def _probe(ex, seen: bool) -> tuple[list[int], str]:
    """Every rank's view, all-reduced: ``[rank]`` 1 where it sees the control file, ``[world +
    rank]`` bytes free in its ``/dev/shm``, ``[2 world + rank]`` its host key, hashed (-1: its
    node index variable is malformed; this rank's error is returned beside)."""
    from conduit_dist.collectives.topology import host_key  # (topology imports the exchange)

    flags = torch.zeros(3 * ex.world, dtype=torch.int64)
    flags[ex.rank] = int(seen)
    flags[ex.world + ex.rank] = _free_bytes()
    bad = ""
    try:
        key = host_key(os.environ, socket.gethostname()).encode()
        flags[2 * ex.world + ex.rank] = int.from_bytes(hashlib.sha1(key).digest()[:7], "little")
    except ConfigError as exc:
        flags[2 * ex.world + ex.rank], bad = -1, str(exc)
    ex.run(lambda: dist.all_reduce(flags, group=ex.group, async_op=True), "shm probe")
    return flags.tolist(), bad


def _off(ex, why: str) -> None:
    """``"auto"`` decided against shared memory: say why, once per plane (rank 0, a WARNING:
    host rows then take gloo's slower path, which a user who left the default should know)."""
    if ex.rank == 0:
        log.warning("transport.shared_memory=auto: off, %s; host rows go through gloo", why)
    return None


def _free_bytes() -> int:
    """Bytes free in ``/dev/shm`` for this process (0 where it cannot be read)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _control_path(token: str) -> str:
    return os.path.join(SHM_DIR, f"conduit-{token}-ctl")


def _open_control(path: str, rank: int, world: int) -> tuple[int, torch.Tensor]:
    """Map the control block and take this rank's lock on it; the descriptor stays open (closing
    it releases the lock) until :meth:`SharedMemory.close`."""
    fd = os.open(path, os.O_RDWR)
    try:
        _native.shm_lock(fd, rank)
        mapped, _ = _map(fd, world * _SLOT)
    except BaseException:
        os.close(fd)
        raise
    return fd, mapped
