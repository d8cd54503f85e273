"""TorchRL compatibility (optional extra ``[torchrl]``): a replay buffer over the DataPlane.

``ShardedReplayBuffer`` speaks the part of ``torchrl.data.TensorDictReplayBuffer`` a training
loop uses (``extend``, ``sample``, ``update_priority``, ``update_tensordict_priority``, ``len``,
``state_dict``), so a TorchRL script changes the line that builds its buffer::

    # rb = TensorDictReplayBuffer(storage=LazyTensorStorage(10_000), batch_size=128)
    rb = ShardedReplayBuffer(capacity_per_rank=10_000 // world, batch_size=128 // world)

Parts: ``layout`` (a TensorDict's nested keys as the plane's fields, and back), ``buffer`` (the
buffer itself). Imported only on request: ``import conduit_dist`` does not need tensordict.
"""

try:
    import tensordict  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "conduit_dist.integrations.torchrl needs tensordict (and torchrl for its example): "
        'pip install -e ".[torchrl]" (from a checkout of conduit_dist)'
    ) from e

from conduit_dist.integrations.torchrl.buffer import ShardedReplayBuffer
from conduit_dist.integrations.torchrl.layout import Layout, flatten

__all__ = ["Layout", "ShardedReplayBuffer", "flatten"]
