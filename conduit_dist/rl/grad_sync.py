"""DDP gradient averaging as a comm hook: latency-bound buckets in one exchange, timed.

gloo's ``all_reduce`` runs a ring: ``2 (w - 1)`` dependent steps, each a round trip. A DQN
network's gradients (17k floats, 69 KB) are latency-bound, so on this project's 2-core test
machine one ``all_to_all_single`` in which every rank sends its whole bucket to every peer, then
sums the ``w`` copies locally, takes 0.37 ms where ``all_reduce`` takes 0.96 ms (2 ranks,
``/tmp``-free loopback, medians). Every rank sums the same rows in the same order, so the
replicas stay bitwise identical. Large buckets keep ``all_reduce`` (it sends ``2 (w-1)/w`` of the
bucket instead of ``w - 1`` copies), and so do buckets that NCCL carries (a CUDA bucket under
``cpu:gloo,cuda:nccl``): the trick is gloo's, NCCL's all-reduce has no such latency to save.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from conduit_dist.collectives.dist import backend_for
from conduit_dist.errors import ConfigError
from conduit_dist.registry import GRAD_SYNCS, check_choice

SMALL_BUCKET_BYTES = 1 << 20  # auto: buckets up to this size (per rank) go through all_to_all


def bucket_collective(mode: str, nbytes: int, backend: str) -> str:
    """How a bucket is averaged: ``"all_to_all"`` (every rank sends every peer its bucket and
    sums the copies: gloo's latency trick) or ``"all_reduce"``.

    Args:
        mode: :class:`GradSync`'s mode (``auto``, ``all_to_all``, ``allreduce``).
        nbytes: the bucket's bytes on this rank.
        backend: the backend that carries the bucket (``dist.backend_for``: ``"gloo"`` for
            host buckets, ``"nccl"`` for CUDA buckets under ``cpu:gloo,cuda:nccl``).

    Returns:
        ``"all_to_all"`` for ``all_to_all``, and for ``auto`` on gloo up to
        :data:`SMALL_BUCKET_BYTES`; ``"all_reduce"`` otherwise (always on NCCL under ``auto``).

    Example::

        bucket_collective("auto", 69_000, "nccl")  # "all_reduce"
    """
    if mode == "all_to_all":
        return "all_to_all"
    if mode == "auto" and backend == "gloo" and nbytes <= SMALL_BUCKET_BYTES:
        return "all_to_all"
    return "all_reduce"


def flat_grads(params: list[torch.Tensor]) -> torch.Tensor:
    """One zeroed buffer holding every parameter's ``.grad`` as a view (backward accumulates into
    it in place), for averaging all gradients in one collective.

    The buffer lives where the parameters do (on the GPU for a network on the GPU: the
    collective then runs on the device, NCCL under the default ``cpu:gloo,cuda:nccl`` group),
    in their dtype.

    Args:
        params: the parameters, all on one device and of one dtype.

    Returns:
        The flat buffer.

    Raises:
        ConfigError: on parameters spread over devices or dtypes, or none.
    """
    kinds = {(p.device, p.dtype) for p in params}
    if len(kinds) != 1:
        raise ConfigError(
            "flat_grads: expected parameters on one device, of one dtype, got "
            f"{sorted(map(str, kinds))}"
        )
    device, dtype = kinds.pop()
    flat = torch.zeros(sum(p.numel() for p in params), device=device, dtype=dtype)
    at = 0
    for p in params:
        p.grad = flat[at : at + p.numel()].view_as(p)
        at += p.numel()
    return flat


class GradSync:
    """Averages gradient buckets over a DDP group and times each collective.

    Args:
        group: DDP's process group.
        mode: one of ``registry.GRAD_SYNCS``: ``all_to_all`` (every bucket), ``allreduce`` (the
            backend's own), ``auto`` (``all_to_all`` for buckets up to
            :data:`SMALL_BUCKET_BYTES` that gloo carries; see :func:`bucket_collective`).

    Raises:
        ConfigError: on an unknown ``mode``.

    Example::

        ddp = DistributedDataParallel(net)
        sync = GradSync(dist.group.WORLD, "auto")
        ddp.register_comm_hook(sync, GradSync.hook)
        ...
        ms = sync.take_ms()  # collective wall time since the last call
    """

    def __init__(self, group: dist.ProcessGroup, mode: str = "auto") -> None:
        check_choice("algo.grad_sync", mode, GRAD_SYNCS)
        if mode == "round":
            raise ConfigError("algo.grad_sync: 'round' averages in the data plane, not in DDP")
        self.group, self.mode = group, mode
        self.world = dist.get_world_size(group)
        self._backend = str(dist.get_backend(group))  # e.g. "cpu:gloo,cuda:nccl"
        self._ms: list[float] = []  # appended by completion callbacks (gloo's thread)

    def take_ms(self) -> float:
        """Milliseconds the bucket collectives took (launch to completion) since the last call."""
        done, self._ms = self._ms, []
        return sum(done)

    @staticmethod
    def hook(sync, bucket):  # unannotated: DDP compares real annotation objects
        """The comm hook DDP calls per bucket (``register_comm_hook(sync, GradSync.hook)``):
        ``(GradSync, dist.GradBucket) -> Future[Tensor]``."""
        return sync.reduce(bucket.buffer())

    def reduce(self, buf: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """Start averaging ``buf`` (a flat bucket) over the group; the future yields the mean."""
        start = time.perf_counter()
        w = self.world
        nbytes = buf.numel() * buf.element_size()
        carrier = backend_for(self._backend, buf.is_cuda)
        if bucket_collective(self.mode, nbytes, carrier) == "all_to_all":
            n = buf.numel()
            inp = buf.repeat(w)
            out = torch.empty_like(inp)
            work = dist.all_to_all_single(out, inp, group=self.group, async_op=True)

            def finish(_fut: torch.futures.Future) -> torch.Tensor:
                self._ms.append((time.perf_counter() - start) * 1e3)
                return out.view(w, n).sum(0).div_(w)

        else:
            buf.div_(w)
            work = dist.all_reduce(buf, group=self.group, async_op=True)

            def finish(fut: torch.futures.Future) -> torch.Tensor:
                self._ms.append((time.perf_counter() - start) * 1e3)
                return fut.value()[0]

        return work.get_future().then(finish)
