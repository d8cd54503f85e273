"""Micro-batches within a token cap when the balanced shares cannot be cut within it.

:func:`conduit_dist.tokens.balance.plan` first balances groups over learners by cost and cuts
each share into the same number ``M`` of micro-batches; ``M`` is at most the smallest share's
group count (no micro-batch is empty), so a learner with many small groups beside one with few
large ones may have to put more tokens in a micro-batch than the cap allows. Then the groups
are packed into ``learners x M`` micro-batches first, by tokens, and those are dealt ``M`` per
learner by cost (:func:`deal`). Pure and deterministic, as the planner is.
"""

from __future__ import annotations

import heapq

from conduit_dist.errors import ConfigError

TRIES = 16  # deal: counts tried from the smallest up, before the largest (one group each)


def fit(tokens: list[int], cost: list[int], idx: list[int], count: int, limit: int):
    """``idx`` into ``count`` non-empty bins: largest group (by tokens) first, into the cheapest
    bin where the bin's tokens stay within ``limit``, else into the bin with fewest tokens (ties
    by bin number). Empty bins are the cheapest, so the first ``count`` groups open them."""
    bins: list[list[int]] = [[] for _ in range(count)]
    load, price = [0] * count, [0] * count
    for i in sorted(sorted(idx), key=lambda i: -tokens[i]):
        room = [b for b in range(count) if load[b] + tokens[i] <= limit]
        b = min(room, key=lambda b: (price[b], b)) if room else load.index(min(load))
        bins[b].append(i)
        load[b] += tokens[i]
        price[b] += cost[i]
    return bins


def pack(tokens: list[int], count: int) -> list[list[int]]:
    """Every group into ``count <= len(tokens)`` non-empty bins: largest first into the bin with
    fewest tokens (ties by bin number)."""
    bins: list[list[int]] = [[] for _ in range(count)]
    heap = [(0, b) for b in range(count)]
    for i in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (load + tokens[i], b))
    return bins


def spread(cost: list[int], bins: list[list[int]], learners: int) -> list[list[list[int]]]:
    """Deal ``bins`` (a multiple of ``learners``) to learners, the same number each: costliest
    first, to the cheapest learner with room (ties by learner number)."""
    per = len(bins) // learners
    price = [sum(cost[i] for i in b) for b in bins]
    shares: list[list[list[int]]] = [[] for _ in range(learners)]
    load = [0] * learners
    for j in sorted(range(len(bins)), key=lambda j: (-price[j], min(bins[j]))):
        r = min((r for r in range(learners) if len(shares[r]) < per), key=lambda r: (load[r], r))
        shares[r].append(sorted(bins[j]))
        load[r] += price[j]
    out = [sorted(mbs, key=lambda m: m[0]) for mbs in shares]
    return sorted(out, key=lambda mbs: min(m[0] for m in mbs))


def _over(tokens: list[int], bins: list[list[int]], limit: int, several: bool) -> bool:
    """Whether a bin exceeds ``limit`` tokens (``several``: only bins of several groups)."""
    return any(sum(tokens[i] for i in b) > limit and (len(b) > 1 or not several) for b in bins)


def deal(
    tokens: list[int], cost: list[int], learners: int, budget: int, cap: int
) -> list[list[list[int]]]:
    """A plan within ``cap``: the groups into ``learners x M`` micro-batches, dealt ``M`` a
    learner by cost.

    ``M`` runs from ``ceil(tokens / (learners x budget))`` up (at most :data:`TRIES` counts, then
    ``len(tokens) // learners``); each count is packed cost-aware (:func:`fit`, cheapest bin with
    room) and, if that overflows, by tokens alone (:func:`pack`). The first count whose
    micro-batches all fit the budget (or hold one group) is taken, else the first within the cap.
    At ``M = len(tokens) // learners`` every group but ``len(tokens) % learners`` sits alone, so a
    plan is found whenever the group count is a multiple of ``learners`` (each group is within the
    cap) or no group exceeds half the cap (a pair then fits).

    Raises:
        ConfigError: when no count gives micro-batches within the cap.
    """
    n = len(tokens)
    top = n // learners
    low = max(1, min(top, -(-sum(tokens) // (learners * budget))))
    counts = list(range(low, min(top, low + TRIES - 1) + 1))
    counts += [top] if top not in counts else []
    within = None
    for m in counts:
        bins = fit(tokens, cost, list(range(n)), learners * m, cap)
        if _over(tokens, bins, cap, False):
            bins = pack(tokens, learners * m)
        if _over(tokens, bins, cap, False):
            continue
        if not _over(tokens, bins, budget, True):
            return spread(cost, bins, learners)
        within = within or bins
    if within is not None:
        return spread(cost, within, learners)
    raise ConfigError(
        f"no plan within token_cap = {cap}: {n} groups (the largest {max(tokens)} tokens) cannot "
        f"be cut into the same number of micro-batches on each of {learners} learners, none "
        f"empty and none over the cap; ask for a multiple of {learners} groups, or raise "
        "token_cap"
    )
