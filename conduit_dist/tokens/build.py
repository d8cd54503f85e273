"""A token plane's parts, built once on every rank (``build``): the shard, the plane's group,
the round and the thread that runs it, pacing and weights (docs/architecture.md, "The token
plane")."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from conduit_dist.collectives.exchange import Exchange
from conduit_dist.collectives.topology import discover
from conduit_dist.collectives.transport import Transport
from conduit_dist.flow.weight_files import WeightFiles
from conduit_dist.flow.weights import WeightsState
from conduit_dist.plane.build import bandwidth_model, rank_set
from conduit_dist.plane.options import TransportConfig
from conduit_dist.records.buffers import use_count
from conduit_dist.rounds.devices import rehearsing
from conduit_dist.tokens.pacing import Pacer
from conduit_dist.tokens.round import TokenRound
from conduit_dist.tokens.runner import TokenRunner
from conduit_dist.tokens.spec import TokenSpec
from conduit_dist.tokens.store import GroupStore

log = logging.getLogger("conduit_dist")

_ids = itertools.count()


@dataclass
class Parts:
    """What ``build`` made (see ``TokenPlane``'s attributes of the same names)."""

    store: GroupStore
    ex: Exchange
    learners: tuple[int, ...]
    pacer: Pacer
    engine: TokenRound
    weights: WeightsState
    runner: TokenRunner


def build(
    spec: TokenSpec,
    device: torch.device,
    capacity: tuple[int, int],
    learner_ranks: Sequence[int] | None,
    producer_ranks: Sequence[int] | None,
    max_age: int | None,
    groups_per_batch: int | None,
    replay: tuple[str | None, float, int],
    transport: TransportConfig,
    cost: str | Callable[[int], float],
    token_cap: int | None,
) -> Parts:
    """Build a token plane's parts (collective: the group, topology and bandwidth model).

    Args:
        spec: the fields; device: the plane's resolved device.
        capacity: ``(sequences, tokens)`` one shard holds.
        learner_ranks, producer_ranks: as ``TokenPlane``'s (``None``: all).
        max_age: ``max_policy_age``; groups_per_batch: pacing's global batch.
        replay: ``(replay, alpha, seed)``.
        transport: timeouts, strategy, bandwidth model, shared memory.
        cost, token_cap: the balance's cost and the micro-batch cap.

    Returns:
        The parts.

    Raises:
        ConfigError: on a bad rank set or pacing setting (the group is released first).
    """
    cuda = device.type == "cuda"
    rehearse = rehearsing() and not cuda  # the device path's logic on a CPU plane
    # arenas on the plane's device: what producers put from GPU tensors stays there, the
    # sections move by the group's backend for CUDA tensors (NCCL), micro-batches are cut
    # where they land
    store = GroupStore(spec, *capacity, cost, token_cap, device)
    # host sections between the ranks of one host go through /dev/shm, as DataPlane's
    # (the same setting and default: transport.shared_memory, agreed at start-up)
    ex = Exchange(
        transport.timeout_s, name=f"tokens{next(_ids)}", device=device,
        shared_memory=transport.shared_memory,
    )  # fmt: skip
    try:
        learners = rank_set("learner_ranks", learner_ranks, ex.world)
        producers = rank_set("producer_ranks", producer_ranks, ex.world)
        topo = discover(ex)
        model, _ = bandwidth_model(transport.bandwidth, ex, topo, transport.bandwidth_cache)
        pacer = Pacer(max_age, groups_per_batch, producers, ex.rank)
    except BaseException:
        ex.close()
        raise
    moves = Transport(ex, topo, model, transport.strategy)
    kind, alpha, seed = replay
    engine = TokenRound(
        store, ex, moves, learners, max_age, kind, float(alpha), int(seed), device, token_cap,
        rehearse,
    )  # fmt: skip
    # weights on the plane's device (published from and pulled into modules there, sent by
    # the group's backend for CUDA tensors); rehearsed on CPU planes
    weights = WeightsState(device if cuda or rehearse else None, transport.weights_bucket_bytes)
    weights.transport = moves  # its topology and bandwidth model price a relay across hosts
    if ex.shm is not None and not (cuda or rehearse):  # host weights through /dev/shm too
        if use_count(torch.zeros(1)) is not None:
            weights.files = WeightFiles(ex.shm.token, ex.rank)
        else:  # without use counts no file could ever be reused: /dev/shm would fill up
            log.warning(
                "token plane: this torch exposes no storage use counts: host weights go over "
                "the group, not through /dev/shm (a file per version would fill it)"
            )
    # where and when rounds run (runner.py): every round on the round thread where its NCCL
    # work must come from one thread (CUDA, or the device path rehearsed)
    runner = TokenRunner(engine, weights, device, transport.timeout_s, cuda or rehearse)
    return Parts(store, ex, learners, pacer, engine, weights, runner)
