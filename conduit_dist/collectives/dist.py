"""Process-group set-up: one ``init_distributed`` for the whole package."""

from __future__ import annotations

import os
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

from conduit_dist.errors import ConfigError

_ENV_INTS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


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


def device_ordinal(local_rank: int | None, visible: int) -> int:
    """The CUDA device index of this process among the ``visible`` devices.

    One visible device per process (SLURM's ``--gpus-per-task=1``, or several ranks sharing one
    GPU) is index 0 whatever ``LOCAL_RANK`` says; with several visible devices the local rank
    picks one.

    Raises:
        ConfigError: with no visible device, or a local rank past the visible devices.
    """
    if visible < 1:
        raise ConfigError(
            "device: expected a visible CUDA device, got none (torch.cuda.device_count() == 0; "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
        )
    if visible == 1:
        return 0
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
        ConfigError: on another device type, CUDA on a machine without it, or an index past
            the visible devices.
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
        return torch.device("cuda", device_ordinal(_env_int("LOCAL_RANK"), visible))
    if not 0 <= dev.index < visible:
        raise ConfigError(f"device: expected cuda:0..cuda:{visible - 1}, got {dev}")
    return dev


def init_distributed(
    device: str | torch.device = "cpu", timeout_s: float = 120.0, backend: str | None = None
) -> None:
    """Initialise the default process group once (a no-op when one exists).

    Under ``torchrun`` the rank and world size come from the environment; under plain ``python``
    (no ``RANK``/``WORLD_SIZE``) a one-rank gloo group is created so the same code runs at world
    size 1. The backend follows the device: ``gloo`` on CPU, ``cpu:gloo,cuda:nccl`` on CUDA (NCCL
    for tensors on the GPU, gloo for CPU-side metadata).

    Args:
        device: the device experience is delivered to (``"cpu"`` or ``"cuda"``).
        timeout_s: default timeout of the group's collectives, in seconds.
        backend: override the backend string passed to ``init_process_group``.

    Raises:
        ConfigError: on malformed or inconsistent ``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` values,
            or a CUDA device on a machine without CUDA.
    """
    if dist.is_initialized():
        return
    if timeout_s <= 0:
        raise ConfigError(f"timeout_s: expected a positive number of seconds, got {timeout_s}")
    device = resolve_device(device)
    if device.type == "cuda":  # before the group exists: NCCL binds to the current device
        torch.cuda.set_device(device)
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if rank is None and world is None:
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
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
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        return
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)


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


def destroy_distributed() -> None:
    """Destroy the default process group if one exists."""
    if dist.is_initialized():
        dist.destroy_process_group()
