"""The package's background threads, every one started here, on its component's device.

A thread's current CUDA device is its own, and a new thread's is GPU 0: a library thread that
touches CUDA without setting it first (a copy, a stream, an event) creates a context on GPU 0,
on every rank of a multi-GPU node, next to the rank's own GPU. Every thread the package starts
(a plane's round worker, a shard's demoter, a checkpoint's writer) goes through
:func:`start_thread` or :func:`executor`, which set the component's resolved CUDA device first
(nothing on CPU). ``tests/test_cuda_defects.py`` refuses a ``threading.Thread`` or
``ThreadPoolExecutor`` created anywhere else in the package.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from conduit_dist.errors import ConfigError


def bind_device(device: torch.device | None) -> None:
    """Make ``device`` the calling thread's current CUDA device; nothing for ``None`` or a host
    device.

    Args:
        device: the component's resolved device (``cuda:<index>``, ``cpu`` or ``None``).

    Raises:
        ConfigError: on a CUDA device without an index ("the current device" of whichever
            thread runs is what this is here to avoid).
    """
    if _check(device):
        torch.cuda.set_device(device)


def start_thread(
    target: Callable[[], None], name: str, device: torch.device | None, daemon: bool = True
) -> threading.Thread:
    """Start a thread that sets its current CUDA device to ``device`` before ``target()``.

    Args:
        target: the thread's work (its errors are the caller's to keep and re-raise).
        name: the thread's name (``conduit-...``).
        device: the component's resolved device (``None`` or ``cpu``: nothing is set).
        daemon: whether the thread is a daemon.

    Returns:
        The started thread.

    Raises:
        ConfigError: on a CUDA device without an index (before any thread starts).

    Example::

        t = start_thread(write, "conduit-checkpoint", snapshot.device)
        t.join()
    """
    _check(device)

    def run() -> None:
        bind_device(device)
        target()

    thread = threading.Thread(target=run, name=name, daemon=daemon)
    thread.start()
    return thread


def executor(name: str, device: torch.device | None, workers: int = 1) -> ThreadPoolExecutor:
    """A thread pool whose threads set their current CUDA device to ``device`` when they start.

    Args:
        name: the threads' name prefix (``conduit-...``).
        device: the component's resolved device (``None`` or ``cpu``: nothing is set).
        workers: the pool's threads.

    Returns:
        The pool.

    Raises:
        ConfigError: on a CUDA device without an index.

    Example::

        pool = executor("conduit-round", torch.device("cuda", 3))
        pool.submit(run_round).result()
    """
    _check(device)
    return ThreadPoolExecutor(workers, name, initializer=bind_device, initargs=(device,))


def _check(device: torch.device | None) -> bool:
    """Whether ``device`` is a CUDA device to set; a CUDA device without an index is refused
    (on the calling thread, before any thread starts).

    Raises:
        ConfigError: naming the device received.
    """
    if device is None or device.type != "cuda":
        return False
    if device.index is None:
        raise ConfigError(
            f"thread device: expected a resolved cuda:<index> or cpu, got {device} "
            "(resolve it once, collectives.dist.resolve_device)"
        )
    return True
