"""Cost-balanced delivery: prompt groups over data-parallel learners, then into micro-batches.

Pure and deterministic (numpy and the standard library only, no ``torch.distributed``): every rank
that calls :func:`plan` with the same token counts and costs gets the same plan, so no collective
is needed to agree on it. Groups are never split; every learner runs the same number of
micro-batches and none is empty; with a cap, no micro-batch holds more tokens than the cap.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import numpy as np

from conduit_dist.errors import ConfigError
from conduit_dist.tokens.deal import deal
from conduit_dist.tokens.deal import fit as _fit

_Subset = tuple[int, list[int]]  # (token sum, item indices)


KK_MAX_PARTS = 8  # micro_batches: Karmarkar-Karp up to this many bins, greedy beyond
KK_MAX_ITEMS = 256  # plan: Karmarkar-Karp over the learners up to this many groups


def _weights(tokens: Sequence[int] | np.ndarray, name: str = "tokens") -> list[int]:
    """Token counts (or costs) as Python ints; ValueError unless a 1-D sequence of positive
    integers."""
    arr = np.asarray(tokens)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(
            f"{name}: expected a 1-D sequence of integer counts, "
            f"got shape {arr.shape} of dtype {arr.dtype}"
        )
    out = [int(w) for w in arr]
    bad = next((i for i, w in enumerate(out) if w <= 0), None)
    if bad is not None:
        raise ValueError(f"{name}[{bad}]: expected a count >= 1, got {out[bad]}")
    return out


def _positive(name: str, value: int) -> int:
    """``value`` as an int; ValueError naming ``name`` unless an integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
    return int(value)


def _order(subset: _Subset) -> tuple[int, float]:
    """Sort key: heaviest first, ties by the subset's first item (deterministic: subsets are
    built by concatenation in a fixed order; empty subsets last)."""
    return (-subset[0], subset[1][0] if subset[1] else math.inf)


def _merge(a: list[_Subset], b: list[_Subset]) -> list[_Subset]:
    """Pair ``a``'s heaviest subset with ``b``'s lightest and so on; result heaviest first."""
    joined = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))]
    return sorted(joined, key=_order)


def _repair(subsets: list[_Subset], weights: list[int]) -> list[_Subset]:
    """Fill empty subsets with the lightest item of the subset holding most items (defensive)."""
    subsets = [(s, list(items)) for s, items in subsets]
    for e in range(len(subsets)):
        if subsets[e][1]:
            continue
        d = max(range(len(subsets)), key=lambda j: (len(subsets[j][1]), -j))
        item = min(subsets[d][1], key=lambda i: (weights[i], i))
        subsets[d][1].remove(item)
        subsets[d] = (subsets[d][0] - weights[item], subsets[d][1])
        subsets[e] = (weights[item], [item])
    return subsets


def partition(tokens: Sequence[int] | np.ndarray, parts: int) -> list[list[int]]:
    """Divide items into ``parts`` subsets of near-equal token sums (Karmarkar-Karp, k-way).

    Each item starts as a ``parts``-tuple of partial sums ``(w, 0, ..., 0)``; the two tuples with
    the largest max-min spread are repeatedly merged, heaviest subset of one with lightest of the
    other, until one tuple is left. Ties break by item index, so the result is deterministic.

    Args:
        tokens: positive token count of each item (prompt group).
        parts: number of subsets (learners), >= 1.

    Returns:
        For each part the sorted list of item indices; parts ordered by their smallest index.
        Every item appears exactly once and every part is non-empty.

    Raises:
        ValueError: ``parts < 1``, fewer items than parts, or a token count <= 0.
    """
    k = _positive("parts", parts)
    weights = _weights(tokens)
    n = len(weights)
    if n < k:
        raise ValueError(
            f"cannot give each of {k} learners a group: the batch has {n}; "
            f"ask for at least {k} groups"
        )
    heap = [(-w, i, [(w, [i])] + [(0, [])] * (k - 1)) for i, w in enumerate(weights)]
    heapq.heapify(heap)
    tie = n
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = _merge(a, b)
        heapq.heappush(heap, (merged[-1][0] - merged[0][0], tie, merged))  # key: -spread
        tie += 1
    subsets = heap[0][2]
    if any(not items for _, items in subsets):
        subsets = _repair(subsets, weights)
    return sorted((sorted(items) for _, items in subsets), key=lambda p: p[0])


def _greedy(weights: list[int], indices: list[int], count: int) -> list[list[int]]:
    """Largest group first into the lightest bin (ties by bin number).

    With few bins an argmin over the loads list (no heap tuples); a heap beyond."""
    bins: list[list[int]] = [[] for _ in range(count)]
    order = sorted(sorted(indices), key=lambda i: -weights[i])  # heaviest first, ties by index
    if count <= 16:
        loads = [0] * count
        for i in order:
            b = loads.index(min(loads))
            bins[b].append(i)
            loads[b] += weights[i]
        return bins
    heap = [(0, b) for b in range(count)]
    for i in order:
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (load + weights[i], b))
    return bins


def _score(
    tokens: list[int], cost: list[int], bins: list[list[int]], budget: int, cap: int | None
) -> tuple[int, int, int]:
    """(micro-batches over the cap, micro-batches of several groups over the budget, heaviest
    micro-batch's cost): lower is better."""
    sums = [sum(tokens[i] for i in b) for b in bins]
    over_cap = 0 if cap is None else sum(s > cap for s in sums)
    over = sum(s > budget and len(b) > 1 for s, b in zip(sums, bins))
    heavy = max(sums) if cost is tokens else max(sum(cost[i] for i in b) for b in bins)
    return over_cap, over, heavy


def micro_batches(
    tokens: Sequence[int] | np.ndarray,
    indices: list[int],
    count: int,
    budget: int,
    costs: Sequence[int] | np.ndarray | None = None,
    cap: int | None = None,
) -> list[list[int]]:
    """Split one learner's groups into exactly ``count`` non-empty micro-batches.

    Both Karmarkar-Karp and greedy largest-first by cost are tried (greedy alone above
    ``KK_MAX_PARTS`` micro-batches, where many small groups per bin leave it within a few
    percent); the one with fewer micro-batches over ``cap``, then fewer multi-group
    micro-batches over ``budget``, then the lighter heaviest micro-batch wins (Karmarkar-Karp on
    a tie). When costs differ from tokens and neither fits, splits balanced by tokens and a
    cost-greedy one that keeps each micro-batch within the limit are tried too. A single group
    over the budget can only be alone, never split.

    Args:
        tokens: positive token count of every group in the batch.
        indices: this learner's groups (distinct indices into ``tokens``).
        count: number of micro-batches, ``1 <= count <= len(indices)``.
        budget: target token budget per micro-batch, >= 1.
        costs: positive cost of every group (``None``: its tokens).
        cap: tokens a micro-batch should not exceed (``None``: no cap); a split within it is
            preferred, but :func:`plan` is what guarantees it.

    Returns:
        ``count`` lists of group indices (each sorted), ordered by their smallest index.

    Raises:
        ValueError: ``count`` out of range, ``budget < 1``, bad or repeated indices, or a token
            count or cost <= 0.
    """
    weights = _weights(tokens)
    cost = _costs(weights, costs)
    count, budget = _positive("count", count), _positive("budget", budget)
    idx = [int(i) for i in indices]
    if len(set(idx)) != len(idx) or any(not 0 <= i < len(weights) for i in idx):
        raise ValueError(
            f"indices: expected distinct indices in [0, {len(weights)}), got {list(indices)}"
        )
    if count > len(idx):
        raise ValueError(
            f"count: expected at most len(indices) = {len(idx)} so no micro-batch is empty, "
            f"got {count}"
        )
    return _micro(weights, cost, idx, count, budget, None if cap is None else _positive("cap", cap))


def _micro(
    tokens: list[int], cost: list[int], idx: list[int], count: int, budget: int, cap: int | None
) -> list[list[int]]:
    """:func:`micro_batches` on checked arguments."""

    def score(bins: list[list[int]]) -> tuple[int, int, int]:
        return _score(tokens, cost, bins, budget, cap)

    cands = [_greedy(cost, idx, count)]
    if count <= KK_MAX_PARTS:  # k-way KK costs O(n k log k) in Python; greedy is near-even here
        cands.insert(0, [[idx[j] for j in p] for p in partition([cost[i] for i in idx], count)])
    best = min(cands, key=score)
    if cost is not tokens and score(best)[:2] != (0, 0):  # by cost it overflows: by tokens?
        cands = [best, _greedy(tokens, idx, count), _fit(tokens, cost, idx, count, cap or budget)]
        if count <= KK_MAX_PARTS:
            cands.append([[idx[j] for j in p] for p in partition([tokens[i] for i in idx], count)])
        best = min(cands, key=score)
    return sorted((sorted(b) for b in best), key=lambda b: b[0])


def _fits(weights: list[int], mbs: list[list[int]], budget: int) -> bool:
    """Whether every micro-batch is within the budget or holds a single group."""
    return all(len(m) == 1 or sum(weights[i] for i in m) <= budget for m in mbs)


def _within(tokens: list[int], mbs: list[list[int]], cap: int | None) -> bool:
    """Whether every micro-batch holds at most ``cap`` tokens (always, without a cap)."""
    return cap is None or all(sum(tokens[i] for i in m) <= cap for m in mbs)


def _need(weights: list[int], share: list[int], budget: int) -> int:
    """Fewest micro-batches for ``share``: one per group over the budget, then the rest's tokens."""
    big = sum(weights[i] > budget for i in share)
    rest = sum(weights[i] for i in share if weights[i] <= budget)
    return big + -(-rest // budget)


def _common_count(
    tokens: list[int], cost: list[int], shares: list[list[int]], budget: int, cap: int | None
) -> list[list[list[int]]]:
    """Every learner's micro-batches at the smallest common count ``M`` (from the largest
    :func:`_need`, capped at the smallest share) at which all of them fit the budget.

    A count is abandoned at the first learner that does not fit, so a search that climbs
    ``j`` counts costs about ``j + learners`` splits, not ``j * learners``. At the smallest
    share's size the split may exceed the budget, and the cap (:func:`plan` checks it)."""
    top = min(len(s) for s in shares)
    m = max(1, min(top, max(_need(tokens, s, budget) for s in shares)))
    while True:
        out = []
        for share in shares:
            out.append(_micro(tokens, cost, share, m, budget, cap))
            if m < top and not _fits(tokens, out[-1], budget):
                m += 1
                break
        else:
            return out


def _costs(tokens: list[int], costs: Sequence[int] | np.ndarray | None) -> list[int]:
    """The groups' costs, checked; ``tokens`` itself when none are given or they equal it (so
    balancing by tokens takes exactly the token path)."""
    if costs is None:
        return tokens
    cost = _weights(costs, "costs")
    if len(cost) != len(tokens):
        raise ValueError(f"costs: expected {len(tokens)} costs (one per group), got {len(cost)}")
    return tokens if cost == tokens else cost


def _check_cap(tokens: list[int], budget: int, cap: int | None) -> int | None:
    """The cap, checked against the budget and every group.

    Raises:
        ConfigError: a budget above the cap, or a group over it.
    """
    if cap is None:
        return None
    cap = _positive("cap", cap)
    if budget > cap:
        raise ConfigError(
            f"token_budget: expected at most token_cap = {cap} (the most tokens a micro-batch "
            f"may hold), got {budget}"
        )
    big = next((i for i, t in enumerate(tokens) if t > cap), None)
    if big is not None:
        raise ConfigError(
            f"tokens[{big}]: a group of {tokens[big]} tokens exceeds token_cap = {cap} "
            "(a group is never split)"
        )
    return cap


def plan(
    tokens: Sequence[int] | np.ndarray,
    learners: int,
    budget: int,
    costs: Sequence[int] | np.ndarray | None = None,
    cap: int | None = None,
) -> list[list[list[int]]]:
    """Cost-balanced plan: groups over learners, then each learner's share into micro-batches.

    Groups go to learners by Karmarkar-Karp (``partition``) on their costs up to
    ``KK_MAX_ITEMS`` groups, by largest-first greedy beyond (with dozens of groups per learner it
    is as even; measured max/mean 1.0000 on 1,024 lognormal groups over 4 learners). Without
    ``costs`` (or with costs equal to the tokens) this is the token-balanced plan.

    The micro-batch count ``M`` starts at the fewest any learner needs: its groups over the budget
    one each, plus ``ceil(rest / budget)`` (equal to ``ceil(learner_tokens / budget)`` when no
    group exceeds the budget). ``M`` is raised until every micro-batch fits the budget or holds a
    single group, and capped at the smallest group count of any learner so no micro-batch is
    empty. When that count binds, some micro-batches exceed the budget: groups are never split
    and every learner runs the same number of micro-batches. With ``cap`` none exceeds the cap:
    when the balanced shares cannot be cut within it, every group is packed by tokens into
    ``learners x M`` micro-batches (the smallest ``M`` that fits) which are dealt ``M`` per
    learner by cost (``tokens/deal.py``); that always succeeds when the group
    count is a multiple of ``learners`` or no group exceeds half the cap.

    Args:
        tokens: positive token count of every prompt group in the global batch.
        learners: number of data-parallel learners, >= 1.
        budget: token budget per micro-batch, >= 1 (a target: the count is sized by it).
        costs: positive cost of every group (the sum of its sequences' ``cost(L)``, integers so
            that every rank plans alike); ``None``: balance by tokens.
        cap: tokens no micro-batch may exceed (``>= budget``; ``None``: no cap).

    Returns:
        ``plan[learner][micro]``: sorted group indices. Every group appears exactly once, every
        learner has the same number ``M >= 1`` of micro-batches, none empty, none over ``cap``.

    Raises:
        ValueError: ``learners < 1``, fewer groups than learners, ``budget < 1``, or a token
            count or cost <= 0.
        ConfigError: (a ValueError) ``budget > cap``, a group over the cap, or no plan within
            the cap (a group count that is not a multiple of ``learners``, groups over half the
            cap).
    """
    weights = _weights(tokens)
    budget = _positive("budget", budget)
    cost = _costs(weights, costs)
    cap = _check_cap(weights, budget, cap)
    if len(weights) <= KK_MAX_ITEMS:
        shares = partition(cost, learners)
    else:  # many groups per learner: largest-first greedy is as even, at a fraction of the cost
        shares = sorted(
            (sorted(b) for b in _greedy(cost, list(range(len(cost))), learners)),
            key=lambda b: b[0],
        )
    out = _common_count(weights, cost, shares, budget, cap)
    if not _within(weights, [m for mbs in out for m in mbs], cap):
        out = deal(weights, cost, learners, budget, cap)
    return out


def imbalance(tokens: Sequence[int] | np.ndarray, parts: list[list[int]]) -> float:
    """Heaviest part's token sum over the mean part sum (1.0 is perfect balance).

    Args:
        tokens: positive token count of every item.
        parts: lists of item indices (an empty part counts as 0 tokens).

    Returns:
        ``max(sums) / mean(sums)``.

    Raises:
        ValueError: ``parts`` is empty or holds no tokens.
    """
    weights = _weights(tokens)
    sums = [sum(weights[i] for i in p) for p in parts]
    if not sums or sum(sums) == 0:
        raise ValueError(f"parts: expected at least one non-empty part, got {parts!r}")
    return max(sums) / (sum(sums) / len(sums))
