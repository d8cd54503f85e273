"""A learner's micro-batch of token experience, in the form training code uses."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class MicroBatch:
    """Whole prompt groups packed without padding (the varlen-attention convention).

    Attributes:
        fields: ragged fields packed ``[tokens, *inner]``; fixed fields ``[sequences, *shape]``
            (the group field among them); ``"_version"`` (int64, each sequence's oldest
            token's policy version), ``"_length"``, ``"_holder"`` (the rank whose shard held
            the group) and ``"_key"`` (its key there; ``update_priorities`` reads both).
        cu_seqlens: ``[sequences + 1]`` int32 cumulative lengths (sequence ``i`` is
            ``packed[cu_seqlens[i]:cu_seqlens[i + 1]]``).
        max_seqlen: the longest sequence's length.
        index: this micro-batch's position among the learner's micro-batches of the global
            batch, and their count (the same on every learner): ``(i, count)``.
        ragged: the names of the ragged fields.
        host: what the round knew on the host of each sequence, so nothing reads the device
            for it: ``"_key"`` and ``"_holder"`` (int64 arrays, as the fields) and
            ``"tokens"`` (a 0-d array; empty for a micro-batch built elsewhere).
    """

    fields: dict[str, torch.Tensor]
    cu_seqlens: torch.Tensor
    max_seqlen: int
    index: tuple[int, int]
    ragged: tuple[str, ...]
    host: dict[str, np.ndarray] = field(default_factory=dict)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.fields[name]

    @property
    def tokens(self) -> int:
        """Tokens in the micro-batch (from the host; read from ``cu_seqlens`` otherwise)."""
        if "tokens" in self.host:
            return int(self.host["tokens"])
        return int(self.cu_seqlens[-1])

    @property
    def sequences(self) -> int:
        """Sequences in the micro-batch."""
        return int(self.cu_seqlens.shape[0] - 1)

    def padded(self, pad: float | int = 0) -> dict[str, torch.Tensor]:
        """The micro-batch padded to its own longest sequence (not the global batch's).

        Args:
            pad: the value padded positions hold in ragged fields.

        Returns:
            ``name -> [sequences, max_seqlen, *inner]`` for ragged fields, the fixed fields as
            they are, and ``"attention_mask"`` (bool, ``[sequences, max_seqlen]``).
        """
        lengths = self.fields["_length"]
        n, width = self.sequences, self.max_seqlen
        mask = torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]
        out = {k: v for k, v in self.fields.items() if k not in self.ragged}
        for name in self.ragged:
            packed = self.fields[name]
            full = packed.new_full((n, width, *packed.shape[1:]), pad)
            full[mask] = packed
            out[name] = full
        out["attention_mask"] = mask
        return out
