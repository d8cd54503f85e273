"""Where a plane's rounds compose and exchange rows, and which schedule runs them (chosen once,
at construction; see ``docs/architecture.md``, "Devices")."""

from __future__ import annotations

import torch

from conduit_dist.sampling.base import ReportsMeta, RoutesFeedback, WritesRows


def rows_on_host(sampler, reduce_numel: int) -> bool:
    """Whether a plane's rows must be composed on the host: the sampler writes trailers or
    windows there (``WritesRows``), or a header exchange (parsed on the host) carries rows,
    shard values, routed feedback or a payload."""
    host_work = WritesRows | ReportsMeta | RoutesFeedback
    return isinstance(sampler, host_work) or reduce_numel > 0


def round_devices(
    world: int, keeps_local: bool, device: torch.device, storage_device: torch.device,
    host_rows: bool, sync: bool,
) -> tuple[str, torch.device]:  # fmt: skip
    """The schedule a plane's rounds run and the device their rows are composed and exchanged
    on (delivery lands them on ``device``, see ``rounds.delivery.Landing``).

    Rows stay on the learner's GPU only where everything a round touches is there: the storage's
    first tier, a sampler that composes nothing on the host (``host_rows`` false), and, above
    one rank, rounds that run on the thread calling ``fetch`` (``sync``). That last rule keeps
    the plane's NCCL kernels in program order with the caller's own (DDP's): kernels of two
    communicators enqueued from two threads can meet in a different order on different ranks
    and wait for each other for ever. Rounds on the overlap worker move rows over gloo, through
    pinned host memory, and use no NCCL communicator at all.

    Schedules: ``local`` at world size 1, ``fused`` where items stay where they were put and
    rows are on the host (its headers are parsed there), else ``general``.
    """
    on_gpu = device.type == "cuda" and storage_device == device and not host_rows
    rows = device if on_gpu and (world == 1 or sync) else torch.device("cpu")
    if world == 1:
        return "local", rows
    return ("fused" if keeps_local and rows.type == "cpu" else "general"), rows
