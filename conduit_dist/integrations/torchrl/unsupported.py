"""What TorchRL's replay buffers take or offer that has no meaning over the sharded plane, and
what to pass or call instead: every such argument or method raises ``NotImplementedError``
saying so (nothing is ignored)."""

from __future__ import annotations

import inspect

from conduit_dist.errors import ConfigError
from conduit_dist.plane import DataPlane
from conduit_dist.sampling import Prioritized, Sampler, Streams
from conduit_dist.tiers import Tiers

# TorchRL constructor arguments with no meaning here, and what to do instead
TORCHRL_KWARGS = {
    "storage": "the plane is the storage: pass capacity_per_rank (and storage=cd.Tiers(...) "
    "for memory and disk tiers)",
    "writer": "the plane writes every item into its shard's ring (oldest evicted first)",
    "transform": "apply the transform to the TensorDict before extend or after sample",
    "collate_fn": "sample() returns a TensorDict of the stored fields",
    "pin_memory": "pass device='cuda' to deliver batches on the GPU",
    "prefetch": "a round delivers each sample; see DataPlane(schedule='overlap') and attach",
    "dim_extend": "extend takes a TensorDict with one batch dimension (td.reshape(-1))",
    "generator": "pass seed=: with the round number it fixes every sample on every rank",
    "shared": "every rank hosts one shard of the global store",
    "compilable": "not supported",
    "delayed_init": "the plane is always built at the first extend",
}
UNSUPPORTED = {
    "empty": "a sharded store cannot be emptied in place; build a new buffer",
    "insert_transform": TORCHRL_KWARGS["transform"],
    "append_transform": TORCHRL_KWARGS["transform"],
    "dumps": "use state_dict() with torch.save, or rb.plane.checkpoint(root)",
    "loads": "use load_state_dict(torch.load(path, weights_only=True)) or rb.plane.restore(root)",
    "set_storage": TORCHRL_KWARGS["storage"],
    "set_writer": TORCHRL_KWARGS["writer"],
    "set_sampler": "pass sampler= when building the buffer",
    "storage": TORCHRL_KWARGS["storage"],
    "writer": TORCHRL_KWARGS["writer"],
    "write_count": "len(rb) is the global number of stored items",
    "mark_update": "not supported",
}
PLANE_ARGS = set(inspect.signature(DataPlane.__init__).parameters) - {
    "self",
    "spec",
    "capacity_per_rank",
    "seed",
    "sampler",
}


def _torchrl_sampler_hint(sampler: object) -> str | None:
    """What to pass instead of a TorchRL sampler object (``None``: not a TorchRL object)."""
    if not type(sampler).__module__.startswith("torchrl"):
        return None
    name = type(sampler).__name__
    hint = {
        "RandomSampler": "sampler='uniform'",
        "PrioritizedSampler": "sampler=cd.Prioritized(alpha, beta, eps)",
        "SamplerWithoutReplacement": "sampler=cd.WithoutReplacement()",
    }.get(name, "one of conduit_dist's samplers (cd.Uniform(), cd.Prioritized(...))")
    return f"sampler: got torchrl's {name}, which does not run on the sharded store; pass {hint}"


def check_sampler(sampler: str | Sampler) -> str | Sampler:
    """``sampler`` as the plane takes it; ``prioritized`` as a name means ``cd.Prioritized()``."""
    hint = _torchrl_sampler_hint(sampler)
    if hint is not None:
        raise NotImplementedError(hint)
    if sampler == "prioritized":
        return Prioritized()
    if isinstance(sampler, Streams):
        raise NotImplementedError(
            "sampler: windowed samplers (sequence=cd.Windows(...)) deliver composed windows; "
            "ShardedReplayBuffer delivers items: use the DataPlane directly for them"
        )
    if not isinstance(sampler, str | Sampler):
        raise ConfigError(
            f"sampler: expected a name or a conduit_dist.Sampler, got {type(sampler).__name__}"
        )
    return sampler


def check_plane_kwargs(plane_kwargs: dict[str, object]) -> None:
    """Refuse TorchRL-only arguments (``NotImplementedError`` saying what to pass instead) and
    names ``DataPlane`` does not take (``ConfigError`` listing those it does)."""
    for name, value in plane_kwargs.items():
        if name in TORCHRL_KWARGS and not (name == "storage" and isinstance(value, Tiers)):
            raise NotImplementedError(f"ShardedReplayBuffer {name}=: {TORCHRL_KWARGS[name]}")
        if name not in PLANE_ARGS:
            raise ConfigError(
                f"ShardedReplayBuffer: unknown argument {name!r} (DataPlane takes "
                f"{sorted(PLANE_ARGS)})"
            )
