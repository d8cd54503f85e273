"""Where a plane's tiers, rows and collectives go: one function of its configuration, decided
once at construction and callable without a GPU (``torch.device("cuda", 0)`` is a plain value).
See ``docs/architecture.md``, "Devices".

The rule: **rows stay where they are stored.** A CUDA plane whose storage's first tier is on its
GPU (the default: the one tier goes where the rows are composed) composes, links, gathers and
delivers rows on that GPU, whatever the sampler: a prioritized sampler's trees, a window's links
and an n-step return are small host metadata, computed on the host and sent up with the indices
(``sampling/device_rows.py``), never the rows themselves. The bulk rows of ingestion and delivery
then move by the group's backend for CUDA tensors (NCCL, one GPU per rank); the meta and header
exchanges (a few hundred bytes a rank) stay on the host (gloo or shared memory). Only a plane
told to keep its first tier in host memory composes rows on the host and lands them on the GPU
with one pinned, non-blocking copy (``rounds.delivery.Landing``).

One thread enqueues a plane's NCCL work: where the plane's group has NCCL and rows or payloads
use it, every round runs on the plane's round thread, in both schedules (``round_thread``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from conduit_dist.sampling.base import Speculative

CPU = torch.device("cpu")

REHEARSAL_ENV = "CONDUIT_DEVICE_ROWS_REHEARSAL"
"""Set to ``1`` to make a CPU plane run the device-rows path on host tensors (gathers by torch,
trailers and n-step values computed from host metadata, no candidates in the header exchange,
the exact delivery exchange, a payload all-reduced): the logic a GPU plane runs, checked on CPU
(``tests/test_device_rows.py``). Not for production: the native host path is faster there."""


def rehearsing() -> bool:
    """Whether :data:`REHEARSAL_ENV` asks CPU planes for the device-rows path."""
    return os.environ.get(REHEARSAL_ENV, "") == "1"


@dataclass(frozen=True)
class DevicePlan:
    """Where one plane's tiers, rows and collectives go.

    Attributes:
        device: where batches are delivered (``cpu`` or ``cuda:<index>``).
        rows: where rounds compose, gather and exchange rows.
        tier: where the default storage's one tier goes (``storage=None``): with the rows.
        schedule: ``local`` (world size 1), ``fused`` (items stay where they were put: one
            header exchange carries the round's counts) or ``general``.
        compose: ``native`` (the extension's host loops) or ``torch`` (gathers on the rows
            device, trailers and n-step values sent up from host metadata).
        bulk: what moves the rows of ingestion and delivery: ``none`` (world size 1), ``host``
            (gloo or shared memory), ``nccl`` or ``gloo`` (CUDA tensors over gloo: ranks
            sharing one GPU).
        candidates: the header exchange carries speculative candidate rows (host rows only:
            the headers are host memory).
        payload: how a fetch's ``reduce`` payload is averaged: ``none``, ``header`` (in the
            header exchange, on the host) or ``allreduce`` (on the rows device, by the group).
        nccl: an NCCL communicator is built (and warmed) for the plane: only where rows or a
            payload go through it.
        round_thread: every round runs on the plane's round thread, in both schedules, so one
            thread enqueues the plane's NCCL work (and the device-rows rehearsal's rounds).
        why: one line saying why rows are where they are.
    """

    device: torch.device
    rows: torch.device
    tier: torch.device
    schedule: str
    compose: str
    bulk: str
    candidates: bool
    payload: str
    nccl: bool
    round_thread: bool
    why: str

    @property
    def cuda_group(self) -> bool:
        """Whether CUDA tensors pass through the plane's group (its rows or its payload): only
        then does the group get a backend for them (and, with NCCL, a communicator)."""
        return self.device.type == "cuda" and (
            self.bulk in ("nccl", "gloo") or self.payload == "allreduce"
        )

    def describe(self) -> str:
        """One line for logs: rows, schedule, bulk transport and why."""
        return (
            f"rows on {self.rows} ({self.compose} composition), {self.schedule} rounds, bulk rows "
            f"by {self.bulk}, metadata on the host, payload {self.payload}"
            f"{', one round thread' if self.round_thread else ''}: {self.why}"
        )


def plan_devices(
    *,
    device: torch.device,
    world: int,
    sampler,
    keeps_local: bool,
    first_tier: torch.device | None = None,
    reduce_numel: int = 0,
    cuda_backend: str = "nccl",
    rehearse: bool | None = None,
) -> DevicePlan:
    """The device plan of a plane (a pure function: no GPU, no process group needed).

    Args:
        device: the plane's resolved device (``cpu`` or ``cuda:<index>``).
        world: ranks in the plane.
        sampler: the plane's sampler (speculative samplers send candidates on host rows).
        keeps_local: the placement keeps items where they were put (``Placement.keeps_local``).
        first_tier: the device of the storage's first tier when ``storage=`` is given (``cpu``
            for pinned, host or disk tiers); ``None``: the default one tier, placed with the
            rows.
        reduce_numel: float32 elements of a fetch's payload (0: none).
        cuda_backend: the backend of the group's CUDA tensors (``nccl`` or ``gloo``).
        rehearse: run the device-rows path on a CPU plane (``None``: :func:`rehearsing`).

    Returns:
        The plan.
    """
    cuda = device.type == "cuda"
    on_gpu = cuda and (first_tier is None or first_tier == device)
    rows = device if on_gpu else CPU
    if rehearse is None:
        rehearse = rehearsing() and not cuda
    device_path = on_gpu or rehearse
    if world == 1:
        schedule, bulk = "local", "none"
    else:
        schedule = "fused" if keeps_local else "general"
        bulk = cuda_backend if rows.type == "cuda" else "host"
    if not reduce_numel or world == 1:
        payload = "none"
    else:
        payload = "allreduce" if (cuda or rehearse) else "header"
    nccl = world > 1 and cuda and cuda_backend == "nccl" and (bulk == "nccl" or payload != "none")
    if not cuda:
        why = "a CPU plane" + (" (device-rows rehearsal)" if rehearse else "")
    elif on_gpu:
        why = "the storage's first tier is on the learner's GPU: rows are composed there"
    else:
        why = (
            f"the storage's first tier is on {first_tier}: rows are composed there and land on "
            f"{device} by one pinned, non-blocking copy"
        )
    return DevicePlan(
        device=device,
        rows=rows,
        tier=rows,
        schedule=schedule,
        compose="torch" if device_path else "native",
        bulk=bulk,
        candidates=isinstance(sampler, Speculative) and not device_path,
        payload=payload,
        nccl=nccl,
        round_thread=nccl or (rehearse and world > 1),  # the rehearsal runs that path too
        why=why,
    )
