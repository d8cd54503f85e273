"""Process-group set-up: one ``init_distributed`` for the whole package."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

# Imported before any process group exists, on purpose: its functions take ``group=group.WORLD``
# as a default, evaluated at import. Imported after ``init_process_group`` (torch imports it
# lazily, e.g. through torch._dynamo when an optimizer is built) those defaults hold the
# default group for good, ``destroy_process_group`` cannot free it, and at interpreter exit its
# gloo worker thread, releasing a finished collective's tensors, needs the GIL and aborts the
# process ("terminate called without an active exception"; seen in CI as an example's exit -6).
import torch.distributed.nn.functional

from conduit_dist.collectives.heartbeats import _STORE_DOWN, _brief, _default_store
from conduit_dist.errors import ConfigError, PhaseError

_ENV_INTS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")

# The one table of backends for CUDA tensors in the package's groups (CPU tensors always go to
# gloo): read by the validation, the error message and docs/multinode.md.
CUDA_BACKENDS: dict[str, str] = {
    "nccl": "NCCL: one GPU per rank (NCCL refuses two ranks on one GPU)",
    "gloo": "gloo over CUDA tensors: slower, but several ranks may share one GPU",
}
CUDA_BACKEND_ENV = "CONDUIT_CUDA_BACKEND"
_chosen_cuda_backend: str | None = None  # what init_distributed(cuda_backend=...) was given
# NCCL's watchdog ends the process this long after the plane's own timeout at the earliest
_WATCHDOG_MARGIN = timedelta(seconds=30)
# plane groups this process has asked for: the same sequence on every rank (creating a group is
# collective, in one order), so the n-th one's arrival keys are the same on every rank
_groups_asked = 0
_ARRIVAL_PREFIX = "conduit_dist/group-arrival/"
_ARRIVAL_PHASE = "start-up: plane group"


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(
            f"environment variable {name}: expected an integer, got {raw!r}"
        ) from None


def device_ordinal(local_rank: int | None, visible: int, world: int = 1) -> int:
    """The CUDA device index of this process among the ``visible`` devices.

    One visible device per process (SLURM's ``--gpus-per-task=1``, or several ranks sharing one
    GPU) is index 0 whatever ``LOCAL_RANK`` says; with several visible devices the local rank
    picks one. Without a local rank, a one-rank job (plain ``python``) takes index 0; a job of
    several ranks is refused: each would take index 0, and NCCL then fails on a duplicate GPU.

    Args:
        local_rank: ``LOCAL_RANK`` (``None``: unset).
        visible: ``torch.cuda.device_count()``.
        world: the job's number of ranks (``WORLD_SIZE``; 1 under plain ``python``).

    Returns:
        The index of this process's device.

    Raises:
        ConfigError: with no visible device, a local rank past the visible devices, or no local
            rank with several visible devices in a job of several ranks.

    Example::

        device_ordinal(3, 8, 16)  # 3
        device_ordinal(None, 8, 1)  # 0: plain python
    """
    if visible < 1:
        raise ConfigError(
            "device: expected a visible CUDA device, got none (torch.cuda.device_count() == 0; "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
        )
    if visible == 1:
        return 0
    if local_rank is None and world > 1:
        raise ConfigError(
            f"LOCAL_RANK: expected it set with WORLD_SIZE={world} and {visible} visible CUDA "
            f"devices (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}), got "
            "none: every rank would take cuda:0; launch with torchrun (it sets LOCAL_RANK) or "
            "pass device='cuda:<index>'"
        )
    local = local_rank or 0
    if not 0 <= local < visible:
        raise ConfigError(
            f"LOCAL_RANK: expected 0 <= LOCAL_RANK < {visible} visible CUDA devices, got {local} "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
        )
    return local


def resolve_device(device: str | torch.device) -> torch.device:
    """The one device this process delivers to: ``cpu``, or ``cuda:<index>`` (bare ``"cuda"``
    resolved once, by :func:`device_ordinal`, never left to mean "the current device").

    Raises:
        ConfigError: on another device type, CUDA on a machine without it, an index past the
            visible devices, or a bare ``"cuda"`` in a job of several ranks without
            ``LOCAL_RANK`` where several devices are visible.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(
            f"device: expected 'cpu', 'cuda' or 'cuda:<index>', got {device!r}"
        ) from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ConfigError(f"device: expected 'cpu', 'cuda' or 'cuda:<index>', got {device!r}")
    if not torch.cuda.is_available():
        raise ConfigError(
            f"device: got {str(device)!r}, but CUDA is not available here (torch "
            f"{torch.__version__}, built with CUDA {torch.version.cuda}); install a CUDA build "
            "of torch (see the README) or pass device='cpu'"
        )
    visible = torch.cuda.device_count()
    if dev.index is None:
        world = get_world_size() if dist.is_initialized() else _env_int("WORLD_SIZE") or 1
        return torch.device("cuda", device_ordinal(_env_int("LOCAL_RANK"), visible, world))
    if not 0 <= dev.index < visible:
        raise ConfigError(f"device: expected cuda:0..cuda:{visible - 1}, got {dev}")
    return dev


def resolve_cuda_backend(explicit: str | None, env: Mapping[str, str]) -> str:
    """The backend for CUDA tensors: ``explicit`` if given, else ``env[CONDUIT_CUDA_BACKEND]``,
    else ``"nccl"``.

    Args:
        explicit: the value passed in code (``init_distributed(cuda_backend=...)``), or ``None``.
        env: the environment to read (``os.environ``).

    Returns:
        A key of :data:`CUDA_BACKENDS`.

    Raises:
        ConfigError: naming the argument or the variable, the allowed values and the received one.

    Example::

        resolve_cuda_backend(None, {"CONDUIT_CUDA_BACKEND": "gloo"})  # "gloo"
    """
    if explicit is not None:
        field, value = "cuda_backend", explicit
    elif CUDA_BACKEND_ENV in env:
        field, value = f"environment variable {CUDA_BACKEND_ENV}", env[CUDA_BACKEND_ENV]
    else:
        return "nccl"
    if value not in CUDA_BACKENDS:
        raise ConfigError(f"{field}: expected one of {list(CUDA_BACKENDS)}, got {value!r}")
    return value


def chosen_cuda_backend() -> str:
    """The backend for CUDA tensors in the package's groups now: what ``init_distributed`` was
    given, else ``CONDUIT_CUDA_BACKEND``, else ``"nccl"``.

    Raises:
        ConfigError: on a value of ``CONDUIT_CUDA_BACKEND`` outside :data:`CUDA_BACKENDS`.
    """
    return resolve_cuda_backend(_chosen_cuda_backend, os.environ)


def plane_backend(uses_cuda: bool, cuda_backend: str = "nccl") -> str:
    """The backend string of a group: ``gloo`` alone when no CUDA tensor will pass through it,
    else gloo for CPU tensors and ``cuda_backend`` for CUDA ones.

    Never copied from another group: a plane whose group copied a user's ``nccl`` default
    group could run none of its CPU collectives (host discovery, meta, weights).

    Args:
        uses_cuda: whether CUDA tensors go through the group (a CUDA plane device).
        cuda_backend: a key of :data:`CUDA_BACKENDS`.

    Returns:
        ``"gloo"`` or ``"cpu:gloo,cuda:<cuda_backend>"``.

    Raises:
        ConfigError: on a ``cuda_backend`` outside :data:`CUDA_BACKENDS`.

    Example::

        plane_backend(True, "nccl")  # "cpu:gloo,cuda:nccl"
    """
    if cuda_backend not in CUDA_BACKENDS:
        raise ConfigError(
            f"cuda_backend: expected one of {list(CUDA_BACKENDS)}, got {cuda_backend!r}"
        )
    return f"cpu:gloo,cuda:{cuda_backend}" if uses_cuda else "gloo"


def uses_cuda(device: str | torch.device) -> bool:
    """Whether CUDA tensors pass through a plane's group: its device is CUDA. (A ``device`` tier
    on a CPU plane keeps the rounds' rows on the host, ``rounds.devices.round_devices``: no CUDA
    tensor reaches the group, which then stays gloo, without an NCCL communicator.)

    Args:
        device: the plane's device.

    Returns:
        ``True`` when the group needs a backend for CUDA tensors.
    """
    return torch.device(device).type == "cuda"


def watchdog_timeout(timeout: timedelta) -> timedelta:
    """The timeout given to an NCCL group whose waits give up after ``timeout``: twice that plus
    30 s, so the plane's :class:`~conduit_dist.errors.RoundError` is raised (and can be caught,
    logged, checkpointed around) well before NCCL's watchdog, which aborts a collective older
    than its group's timeout and with it, by default, the process.

    Args:
        timeout: the plane's timeout of one collective.

    Returns:
        The group's timeout.
    """
    return 2 * timeout + _WATCHDOG_MARGIN


def default_group_timeout(backend: str, timeout: timedelta) -> timedelta:
    """The timeout :func:`init_distributed` gives the default group: :func:`watchdog_timeout`
    of ``timeout`` where the group has NCCL (its watchdog would otherwise end the process at
    the moment the plane raises its own named error), else ``timeout`` itself.

    The package's own waits on the default group (``metrics.aggregate``, through an
    ``Exchange``) still give up after ``timeout``.

    Args:
        backend: the group's backend string (``"gloo"``, ``"cpu:gloo,cuda:nccl"``, ``"nccl"``).
        timeout: the timeout asked for (``init_distributed(timeout_s=...)``).

    Returns:
        The group's timeout.

    Example::

        default_group_timeout("cpu:gloo,cuda:nccl", timedelta(seconds=60))  # 150 s
    """
    return watchdog_timeout(timeout) if "nccl" in backends_of(backend) else timeout


def plane_group(
    timeout: timedelta, cuda: torch.device | None, cuda_backend: str = "nccl"
) -> dist.ProcessGroup:
    """A new group over all ranks for one plane (a collective call), with the backend of
    :func:`plane_backend`, never the default group's.

    With NCCL for CUDA tensors, the group's timeout is :func:`watchdog_timeout` of the plane's,
    and ``device_id`` binds it to ``cuda`` (torch then creates the NCCL communicator at once,
    on this thread, instead of inside the first collective).

    Args:
        timeout: the plane's timeout of one collective.
        cuda: the CUDA device of the tensors passing through the group (``None``: CPU only).
        cuda_backend: a key of :data:`CUDA_BACKENDS`.

    Returns:
        The group.

    Every rank first says it arrived, in the default group's store (:func:`await_arrival`):
    a rank that never comes fails this phase by name within ``timeout``, where ``new_group``'s
    own rendezvous would wait for the new group's timeout (with NCCL, twice it plus 30 s) and
    fail naming nobody.

    Raises:
        ConfigError: on a ``cuda_backend`` outside :data:`CUDA_BACKENDS`, or a default group bound
            to another CUDA device than ``cuda``.
        PhaseError: ``start-up: plane group``, naming the ranks that did not arrive in time.
    """
    backend = plane_backend(cuda is not None, cuda_backend)
    await_arrival(timeout)
    if cuda is None or cuda_backend != "nccl":
        return dist.new_group(timeout=timeout, backend=backend)
    bound = getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None)
    if bound is not None and bound != cuda:  # torch would refuse with a bare AssertionError
        raise ConfigError(
            f"device: the default process group is bound to {bound} (init_process_group("
            f"device_id=...)), but this rank's plane uses {cuda}: expected the same device"
        )
    return dist.new_group(timeout=watchdog_timeout(timeout), backend=backend, device_id=cuda)


def await_arrival(timeout: timedelta) -> None:
    """Wait, at most ``timeout``, until every rank has reached the same plane group creation.

    Each rank sets its key in the default group's store, under the sequence number of this
    creation (every rank's n-th), and polls until every rank's is there. Nothing is waited for
    at world size 1 or without a store (a private torch API: ``heartbeats._default_store``).

    Args:
        timeout: the plane's timeout of one collective.

    Raises:
        PhaseError: ``start-up: plane group`` when ranks have not arrived by ``timeout`` (named)
            or the store stops answering.
    """
    global _groups_asked
    _groups_asked += 1
    world = dist.get_world_size()
    store, _ = _default_store()
    if store is None or world == 1:
        return
    rank, limit = dist.get_rank(), timeout.total_seconds()
    keys = [f"{_ARRIVAL_PREFIX}{_groups_asked}/{r}" for r in range(world)]
    start = time.monotonic()
    pause = 1e-3
    try:
        store.set(keys[rank], "1")
        while not store.check(keys):
            if time.monotonic() - start >= limit:
                missing = [r for r, k in enumerate(keys) if not store.check([k])]
                if missing:
                    _arrival_failed(rank, start, limit, missing, None)
                return
            time.sleep(min(pause, max(0.0, start + limit - time.monotonic())))
            pause = min(2 * pause, 0.05)
    except _STORE_DOWN as exc:
        _arrival_failed(rank, start, limit, [], exc)


def _arrival_failed(
    rank: int, start: float, limit: float, missing: list[int], exc: BaseException | None
) -> None:
    """Raise :func:`await_arrival`'s ``PhaseError`` (worded as ``Exchange``'s phase errors)."""
    how = f"failed on rank {rank} after {time.monotonic() - start:.1f}s (timeout {limit:g}s)"
    if missing:
        who = (
            f"ranks {missing} never entered this phase (a rank that crashed shows its own "
            "error; one that is alive has not built its plane: every rank builds the same "
            "planes in the same order)"
        )
    else:
        who = f"the rendezvous store did not answer ({_brief(exc)})"
    raise PhaseError(
        f"{_ARRIVAL_PHASE}: arrival {how}; {who}", phase=_ARRIVAL_PHASE, ranks=tuple(missing)
    ) from exc


def backends_of(group_backend: str) -> set[str]:
    """The backends named in a group's backend string (``"cpu:gloo,cuda:nccl"``: gloo, nccl)."""
    return {part.rsplit(":", 1)[-1] for part in group_backend.split(",") if part}


def cuda_backend_of(group_backend: str) -> str:
    """The backend that carries a group's CUDA tensors: the one named for ``cuda``
    (``"cpu:gloo,cuda:nccl"``: nccl), else the group's only one (``"gloo"``: gloo)."""
    return backend_for(group_backend, cuda=True)


def backend_for(group_backend: str, cuda: bool) -> str:
    """The backend that carries a group's CUDA tensors (``cuda``) or host tensors: the one named
    for that device type (``"cpu:gloo,cuda:nccl"``: nccl for CUDA, gloo for the host), else the
    group's last one (``"gloo"``: gloo).

    Args:
        group_backend: the group's backend string (``str(dist.get_backend(group))``).
        cuda: whether the tensors are on the GPU.

    Returns:
        A backend name, e.g. ``"gloo"`` or ``"nccl"``.
    """
    kind = "cuda" if cuda else "cpu"
    parts = [part.split(":") for part in group_backend.split(",") if part]
    for part in parts:
        if len(part) == 2 and part[0] == kind:
            return part[1]
    return parts[-1][-1]


def init_distributed(
    device: str | torch.device = "cpu",
    timeout_s: float = 120.0,
    backend: str | None = None,
    cuda_backend: str | None = None,
) -> None:
    """Initialise the default process group once (a no-op when one exists).

    Under ``torchrun`` the rank and world size come from the environment; under plain ``python``
    (no ``RANK``/``WORLD_SIZE``) a one-rank gloo group is created so the same code runs at world
    size 1. The backend follows the device, by :func:`plane_backend` (the rule of the planes'
    own groups too): ``gloo`` on CPU, ``cpu:gloo,cuda:nccl`` on CUDA (NCCL for tensors on the
    GPU, gloo for CPU-side metadata). With NCCL the group's timeout is
    :func:`default_group_timeout` (twice ``timeout_s`` plus 30 s: NCCL's watchdog ends the
    process only well after the plane's own errors); the package's own waits on it
    (``metrics.aggregate``) still give up after ``timeout_s``. It is not bound to the device:
    its NCCL communicator is created at its first CUDA collective (DDP's), and never in a job
    that puts no CUDA tensor through it (``train.py``'s DQN averaging its gradients in the
    plane's rounds uses the plane's communicator alone).

    Args:
        device: the device experience is delivered to (``"cpu"``, ``"cuda"`` or ``"cuda:<i>"``).
        timeout_s: how long a collective may take, in seconds (with NCCL the group's own
            timeout is longer, see above).
        backend: override the backend string passed to ``init_process_group``.
        cuda_backend: the backend for CUDA tensors, here and in every plane's group: ``"nccl"``
            or ``"gloo"`` (several ranks sharing one GPU); ``None``: ``CONDUIT_CUDA_BACKEND``,
            else ``"nccl"``. Recorded even when a group already exists.

    Raises:
        ConfigError: on malformed or inconsistent ``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` values,
            a CUDA device on a machine without CUDA, or a ``cuda_backend`` (or
            ``CONDUIT_CUDA_BACKEND``) outside :data:`CUDA_BACKENDS`.

    Example::

        init_distributed("cuda", cuda_backend="gloo")  # 2 ranks on one GPU
    """
    global _chosen_cuda_backend
    chosen = resolve_cuda_backend(cuda_backend, os.environ)
    if cuda_backend is not None:
        _chosen_cuda_backend = chosen
    if dist.is_initialized():
        return
    if timeout_s <= 0:
        raise ConfigError(f"timeout_s: expected a positive number of seconds, got {timeout_s}")
    device = resolve_device(device)
    if device.type == "cuda":  # before the group exists: NCCL binds to the current device
        torch.cuda.set_device(device)
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if backend is None:
        backend = plane_backend(device.type == "cuda", chosen)
    timeout = timedelta(seconds=timeout_s)
    group_timeout = default_group_timeout(backend, timeout)
    if rank is None and world is None:
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=group_timeout
        )
        return
    if rank is None or world is None:
        raise ConfigError(
            f"RANK and WORLD_SIZE must be set together, got RANK={rank} WORLD_SIZE={world}"
        )
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"RANK: expected 0 <= RANK < WORLD_SIZE={world}, got {rank}")
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise ConfigError(
            "MASTER_ADDR and MASTER_PORT must be set with RANK/WORLD_SIZE (launch with torchrun)"
        )
    attempt = _env_int("TORCHELASTIC_RESTART_COUNT")
    if attempt:  # a group torchrun restarted: keys of the dead attempt are still in its store
        store = _attempt_store(rank, world, attempt, timeout)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world, timeout=group_timeout
        )
        return
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=group_timeout)


def _attempt_store(rank: int, world: int, attempt: int, timeout: timedelta) -> dist.Store:
    """The launcher's store under a prefix of this restart attempt.

    torchrun keeps its agent's TCPStore across ``--max-restarts`` restarts (torch 2.13,
    ``--standalone``), and groups made with ``new_group`` store their peers' addresses under
    the same keys in every attempt: a restarted rank that reaches a group before its peer
    reads the dead attempt's address and times out connecting (measured: ``Gloo
    connectFullMesh failed ... Connection refused``). ``TORCHELASTIC_RESTART_COUNT`` is the
    same on every rank whose agents restarted together (one agent, or all of them); a node
    that rejoins with a fresh agent would count differently (not supported: its ranks time
    out at start-up).
    """
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
        is_master=not agent and rank == 0, timeout=timeout,
    )  # fmt: skip
    return dist.PrefixStore(f"conduit_dist/attempt{attempt}", store)


def get_rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    """Number of ranks (1 without a process group)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def is_rank_zero() -> bool:
    """Whether this is global rank 0."""
    return get_rank() == 0


_on_destroy: list[Callable[[], None]] = []


def on_destroy(fn: Callable[[], None]) -> None:
    """Have :func:`destroy_distributed` call ``fn`` first (once per registration).

    For module-level objects that hold the default group (e.g. the metrics' ``Exchange``): they
    must let go of it before it is destroyed, or the group lives until interpreter exit, where
    its gloo worker thread, finishing a collective, needs the GIL and aborts the process
    ("terminate called without an active exception"; seen as a rank exiting -6 right after a
    run's last ``metrics.aggregate``).

    Args:
        fn: called with no arguments; should drop references, not run collectives.
    """
    if fn not in _on_destroy:
        _on_destroy.append(fn)


def destroy_distributed() -> None:
    """Destroy the default process group if one exists (and forget ``init_distributed``'s
    ``cuda_backend``), after the :func:`on_destroy` callbacks let go of it."""
    global _chosen_cuda_backend
    _chosen_cuda_backend = None
    for fn in list(_on_destroy):
        fn()
    if dist.is_initialized():
        dist.destroy_process_group()
