"""A plane's state between rounds: what ``DataPlane.state_dict`` saves and how it is restored.

Tensors, ints and plain dicts only (loads with ``torch.load(..., weights_only=True)``).
"""

from __future__ import annotations

import torch

from conduit_dist.errors import ConfigError
from conduit_dist.records.spec import ExperienceSpec


def save(parts, spec: ExperienceSpec) -> dict[str, object]:
    """This rank's state; the caller has waited for its running round.

    Raises:
        RuntimeError: if items were put since the last round was prepared.
    """
    if parts.stager.pending:
        raise RuntimeError(
            f"state_dict: {parts.stager.pending} items were put since the last round was "
            "prepared; run a round (fetch or flush) first, on every rank"
        )
    return {
        "round": parts.clock.round,
        "runner": parts.runner.state_dict(),
        "shard": parts.shard.state_dict(),
        "spec": spec.state_dict(),
        # policy versions: the one this rank's puts carry, its publications, the received one
        "versions": {
            "put": parts.stager.version,
            "published": parts.stager.publishes,
            "received": parts.weights.version,
        },
    }


def load(parts, spec: ExperienceSpec, state: dict[str, object]) -> None:
    """Restore ``state`` on every rank (collective: the ranks check they agree on the round).

    Raises:
        ConfigError: on another spec or world size, staged items, or ranks at different rounds.
    """
    if state["spec"] != spec.state_dict():
        raise ConfigError(f"spec: checkpoint has {state['spec']}, plane has {spec.state_dict()}")
    world = state["runner"]["sizes"].shape[0]
    if world != parts.exchange.world:
        raise ConfigError(f"world size: checkpoint has {world}, plane has {parts.exchange.world}")
    quiet_for_restore(parts, "load_state_dict")
    r = int(state["round"])
    mine = torch.tensor([r], dtype=torch.int64)
    rounds = parts.exchange.all_gather_start(mine, parts.clock.round).wait()[:, 0].tolist()
    if len(set(rounds)) != 1:
        raise ConfigError(
            f"load_state_dict: ranks restored different rounds {rounds} (by rank); load the "
            "checkpoint every rank saved at the same point"
        )
    parts.shard.load_state_dict(state["shard"])
    parts.runner.load_state_dict(state["runner"])
    versions = state.get("versions")
    if versions is not None:
        parts.stager.version = int(versions["put"])
        parts.stager.publishes = int(versions["published"])
        parts.weights.version = max(parts.weights.version, int(versions["received"]))
    parts.clock.round = r


def quiet_for_restore(parts, what: str) -> None:
    """Before a restore overwrites this rank's state: nothing staged, no round in flight (a
    round launched before the restore is finished; its batch would be stale).

    Raises:
        ConfigError: naming ``what``, if items were put since the last round.
    """
    if parts.stager.pending:
        raise ConfigError(
            f"{what}: {parts.stager.pending} items were put since the last round; restore "
            "before putting"
        )
    if parts.sched.pending is not None:
        parts.clock.wait()
