"""What a sequence costs a learner: the weight a token round balances learners by.

A cost maps sequence lengths to positive integers. It is evaluated once per sequence, on the
rank that puts it (``GroupStore.add``), and a group's cost (the sum over its members) travels
as an integer column of the round's group table, so every rank plans from the same integers
whatever its floating-point arithmetic. The token cap is always on tokens, whatever the cost.

The table of allowed names is :data:`COSTS`; ``TokenPlane(cost=...)`` also takes a
:class:`Flops` with other coefficients, or any callable ``L -> cost``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from conduit_dist.errors import ConfigError, SpecError

INT_LIMIT = 2**62  # a group's cost (group_size members of max_len) must stay below this


class Tokens:
    """``cost(L) = L``: balance by tokens (the default; plans as before costs existed)."""

    def __call__(self, lengths: np.ndarray) -> np.ndarray:
        return np.asarray(lengths, dtype=np.int64)

    def __repr__(self) -> str:
        return "Tokens()"


@dataclass(frozen=True)
class Flops:
    """``cost(L) = a*L + b*L**2``: one transformer layer's compute for a sequence of ``L``.

    Derivation (``d = d_model``, 2 FLOPs a multiply-add): per token the dense parts cost
    ``24 d^2`` (Q, K, V and output projections ``8 d^2``, an MLP with a ``4 d`` hidden layer
    ``16 d^2``); attention costs ``4 d`` per (query, key) pair (``Q K^T`` ``2 d``, ``A V``
    ``2 d``), and a causal sequence has about ``L^2 / 2`` pairs (flash kernels skip the masked
    half): ``24 d^2 L + 2 d L^2 = 2 d (12 d L + L^2)``. So ``a = 12 d``, ``b = 1`` in units of
    ``2 d`` FLOPs; the defaults are ``d = 4096`` (a 7-8B model): ``a = 49152``, ``b = 1``, where
    attention equals the dense parts at ``L = 49152`` and is 17% of them at ``L = 8192``.
    The backward costs about twice the forward in both terms, so the ratio holds for a step.
    :meth:`for_model` gives other widths, and non-causal attention (``L^2`` pairs: ``a = 6 d``).

    Integer coefficients are evaluated exactly in int64; others in float64 and rounded.

    Raises:
        ConfigError: on a coefficient that is not a finite number >= 0, or ``a + b < 1`` (a
            sequence of one token must cost at least 1).
    """

    a: float = 12 * 4096
    b: float = 1

    def __post_init__(self) -> None:
        for name in ("a", "b"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ConfigError(f"Flops.{name}: expected a finite number >= 0, got {v!r}")
            if v < 0:
                raise ConfigError(f"Flops.{name}: expected a finite number >= 0, got {v!r}")
        if self.a + self.b < 1:
            raise ConfigError(
                f"Flops: expected a + b >= 1 (a one-token sequence costs at least 1), got "
                f"a={self.a!r}, b={self.b!r}; scale both up"
            )

    @classmethod
    def for_model(cls, d_model: int, causal: bool = True) -> Flops:
        """The coefficients for a model of width ``d_model`` (see the class docstring)."""
        if isinstance(d_model, bool) or not isinstance(d_model, int) or d_model < 1:
            raise ConfigError(f"d_model: expected an int >= 1, got {d_model!r}")
        return cls(a=(12 if causal else 6) * d_model, b=1)

    def __call__(self, lengths: np.ndarray) -> np.ndarray:
        n = np.asarray(lengths, dtype=np.int64)
        if float(self.a).is_integer() and float(self.b).is_integer():
            return int(self.a) * n + int(self.b) * n * n
        return np.rint(self.a * n.astype(np.float64) + self.b * n.astype(np.float64) ** 2).astype(
            np.int64
        )


class PerSequence:
    """A user's ``L -> cost`` applied to each distinct length of a put, rounded to an int."""

    def __init__(self, fn: Callable[[int], float]) -> None:
        self.fn = fn

    def __call__(self, lengths: np.ndarray) -> np.ndarray:
        n = np.asarray(lengths, dtype=np.int64)
        uniq, inverse = np.unique(n, return_inverse=True)
        vals = np.array([self._one(int(L)) for L in uniq], dtype=np.int64)
        return vals[inverse].reshape(n.shape)

    def _one(self, length: int) -> int:
        try:
            v = float(self.fn(length))
        except (TypeError, ValueError) as exc:
            raise SpecError(
                f"cost: {self.fn!r}({length}) did not return a number ({exc})"
            ) from None
        if not math.isfinite(v) or round(v) < 1 or round(v) >= INT_LIMIT:
            raise SpecError(
                f"cost: {self.fn!r}({length}) returned {v!r}; a sequence's cost must round to "
                f"an int in [1, 2**62) (scale the cost up or down)"
            )
        return round(v)

    def __repr__(self) -> str:
        return f"PerSequence({self.fn!r})"


COSTS: dict[str, Callable[[], Callable[[np.ndarray], np.ndarray]]] = {
    "tokens": Tokens,
    "flops": Flops,
}


def resolve(value: object, max_len: int, group_size: int) -> Callable[[np.ndarray], np.ndarray]:
    """The cost a plane's ``cost=`` names: a name in :data:`COSTS`, a :class:`Tokens` or
    :class:`Flops`, or a callable ``L -> cost`` (wrapped in :class:`PerSequence`).

    It is tried on lengths 1 and ``max_len`` at once, so a cost that cannot serve fails at
    construction rather than at a put.

    Raises:
        ConfigError: on an unknown name or a value that is neither, naming the allowed ones; on
            a cost below 1, or one whose group of ``group_size`` longest sequences would not
            fit an int64.
    """
    if isinstance(value, str) and value in COSTS:
        cost = COSTS[value]()
    elif isinstance(value, (Tokens, Flops)):
        cost = value
    elif callable(value) and not isinstance(value, (str, type)):
        cost = PerSequence(value)
    else:
        raise ConfigError(
            f"cost: expected one of {list(COSTS)}, a Flops(a, b) or a callable L -> cost, "
            f"got {value!r}"
        )
    try:
        low, high = (int(c) for c in cost(np.array([1, max_len], dtype=np.int64)))
    except SpecError as exc:
        raise ConfigError(str(exc)) from None
    if low < 1 or high * group_size >= INT_LIMIT:
        raise ConfigError(
            f"cost: expected cost(1) >= 1 and group_size x cost(max_len) < 2**62, got "
            f"cost(1) = {low}, cost({max_len}) = {high} with group_size {group_size}"
        )
    return cost
