"""The bytes a token round moves: one section per (holder, learner), columns without padding.

A section carries ``n`` sequences and their ``t`` tokens as consecutive columns: each fixed
field's ``[n, *shape]`` values, the lengths and versions (int64), then each ragged field's
``[t, *inner]`` values; every column starts at an 8-byte boundary (at most 7 bytes of padding
per column, whatever the sequences' lengths). Every rank computes every section's size from
the round's replicated group table, so the exchange needs no size message of its own.
"""

from __future__ import annotations

import math

import torch

from conduit_dist.tokens.spec import TokenSpec

# the reserved per-sequence columns: length, oldest token's version, the holder's group key
LENGTHS, VERSIONS, KEYS = "_length", "_version", "_key"


def _align(n: int) -> int:
    return (n + 7) & ~7


class Wire:
    """Column layout of a section for one token spec.

    Args:
        spec: the token spec.
    """

    def __init__(self, spec: TokenSpec) -> None:
        self.fixed = {n: (f.shape, f.dtype) for n, f in spec.fixed.items()}
        self.fixed[LENGTHS] = ((), torch.int64)
        self.fixed[VERSIONS] = ((), torch.int64)
        self.fixed[KEYS] = ((), torch.int64)
        self.ragged = {n: (f.inner, f.dtype) for n, f in spec.ragged.items()}
        self.seq_bytes = sum(math.prod(s) * d.itemsize for s, d in self.fixed.values())
        self.token_bytes = sum(math.prod(s) * d.itemsize for s, d in self.ragged.values())

    def nbytes(self, n: int, t: int) -> int:
        """Bytes of a section of ``n`` sequences holding ``t`` tokens."""
        if n == 0:
            return 0
        fixed = sum(_align(n * math.prod(s) * d.itemsize) for s, d in self.fixed.values())
        return fixed + sum(_align(t * math.prod(s) * d.itemsize) for s, d in self.ragged.values())

    def offsets(self, n: int, t: int) -> dict[str, int]:
        """Byte offset of each column in a section of ``n`` sequences and ``t`` tokens."""
        out, at = {}, 0
        for rows, table in ((n, self.fixed), (t, self.ragged)):
            for name, (shape, dtype) in table.items():
                out[name] = at
                at += _align(rows * math.prod(shape) * dtype.itemsize)
        return out

    def columns(self, buf: torch.Tensor, n: int, t: int) -> dict[str, torch.Tensor]:
        """Typed views of a section's columns inside ``buf`` (uint8, 8-byte aligned start)."""
        out = {}
        for name, at in self.offsets(n, t).items():
            shape, dtype = self.fixed.get(name) or self.ragged[name]
            rows = t if name in self.ragged else n
            nb = rows * math.prod(shape) * dtype.itemsize
            out[name] = buf[at : at + nb].view(dtype).view(rows, *shape)
        return out
