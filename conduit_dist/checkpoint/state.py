"""A plane's state as its parts' state dicts: what ``DataPlane.state_dict`` returns and what a
checkpoint's small state holds (one format), and loading it back in memory (same world size).

Tensors, ints, floats, strings and plain dicts only (loads with
``torch.load(..., weights_only=True)``).
"""

from __future__ import annotations

import torch

from conduit_dist.errors import ConfigError


def parts_state(parts, spec, storage: bool = True) -> dict[str, object]:
    """``{part: part.state_dict()}`` of this rank (``storage``: with the shard's items; a
    checkpoint writes those itself); the caller has waited for its running round."""
    out: dict[str, object] = {
        "spec": spec.state_dict(),
        "clock": parts.clock.state_dict(),
        "engine": parts.engine.state_dict(),
        "sampler": parts.sampler.state_dict(),
        "placement": parts.placement.state_dict(),
        "versions": parts.versions.state_dict(),
        "weights": parts.weights.state_dict(),
        "ages": parts.ages.state_dict(),
        "stager": parts.stager.state_dict(),
        "control": parts.control.state_dict(),
    }
    if parts.limiter is not None:
        out["limiter"] = parts.limiter.state_dict()
    if storage:
        out["storage"] = parts.storage.state_dict()
    return out


def save(parts, spec) -> dict[str, object]:
    """This rank's state (see :func:`parts_state`).

    Raises:
        RuntimeError: if items were put since the last round was prepared.
    """
    if parts.stager.pending:
        raise RuntimeError(
            f"state_dict: {parts.stager.pending} items were put since the last round was "
            "prepared; run a round (fetch or flush) first, on every rank"
        )
    return parts_state(parts, spec)


def load(parts, spec, state: dict[str, object]) -> None:
    """Restore ``state`` on every rank (collective: the ranks check they agree on the round).

    Raises:
        ConfigError: on another spec or world size, staged items, or ranks at different rounds.
    """
    if state["spec"] != spec.state_dict():
        raise ConfigError(f"spec: checkpoint has {state['spec']}, plane has {spec.state_dict()}")
    world = state["engine"]["sizes"].shape[0]
    if world != parts.exchange.world:
        raise ConfigError(f"world size: checkpoint has {world}, plane has {parts.exchange.world}")
    _check_parts(parts, state)
    quiet_for_restore(parts, "load_state_dict")
    r = int(state["clock"]["round"])
    mine = torch.tensor([r], dtype=torch.int64)
    rounds = parts.exchange.all_gather_start(mine, parts.clock.round).wait()[:, 0].tolist()
    if len(set(rounds)) != 1:
        raise ConfigError(
            f"load_state_dict: ranks restored different rounds {rounds} (by rank); load the "
            "checkpoint every rank saved at the same point"
        )
    parts.storage.load_state_dict(state["storage"])
    for name in ("engine", "sampler", "placement", "weights", "ages", "stager", "control"):
        getattr(parts, name).load_state_dict(state[name])
    parts.versions.load_state_dict(state["versions"])
    if parts.limiter is not None and "limiter" in state:
        parts.limiter.load_state_dict(state["limiter"])
    parts.clock.load_state_dict(state["clock"])


def _check_parts(parts, state: dict[str, object]) -> None:
    """Refuse, before anything is loaded, the state of another sampler or placement.

    Raises:
        ConfigError: naming the part, what the state holds and what the plane has.
    """
    parts.sampler.check_state(state["sampler"])
    want, have = sorted(parts.placement.state_dict()), sorted(state["placement"])
    if want != have:
        raise ConfigError(
            f"placement: the state holds {have}, the plane's {parts.placement.name!r} keeps "
            f"{want}: load it into a plane built with the same placement"
        )


def quiet_for_restore(parts, what: str) -> None:
    """Before a restore overwrites this rank's state: nothing staged, no round in flight (a
    round launched before the restore is finished; its batch would be stale), and on CUDA the
    caller's stream ordered after the rounds' device work.

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
    # CUDA: the restore's copies into the tiers come after every round's (and the next
    # round's side stream after the restore's): Scheduler.join
    if parts.clock.cuda is not None:
        parts.sched.join()
