"""Token-balanced delivery: Karmarkar-Karp partition of prompt groups over learners, micro-batches
with equal counts and none empty, a group over the budget alone, determinism, balance quality."""

from __future__ import annotations

import heapq
import math

import numpy as np
import pytest

from conduit_dist.tokens.balance import _repair, imbalance, micro_batches, partition, plan


def _lognormal_groups(seed: int, groups: int = 64, per_group: int = 8) -> np.ndarray:
    """Group token counts: 8 sequences each, lengths lognormal (median 256), 1% near 8k."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(math.log(256), 1.0, groups * per_group), 16, 8192)
    long = rng.random(lengths.size) < 0.01
    lengths[long] = rng.integers(6144, 8193, int(long.sum()))
    return lengths.astype(np.int64).reshape(groups, per_group).sum(axis=1)


def _greedy(tokens: np.ndarray, k: int) -> list[list[int]]:
    """Baseline: largest group first onto the lightest learner."""
    parts: list[list[int]] = [[] for _ in range(k)]
    heap = [(0, j) for j in range(k)]
    for i in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        load, j = heapq.heappop(heap)
        parts[j].append(i)
        heapq.heappush(heap, (load + int(tokens[i]), j))
    return parts


def _check_plan(tokens, learners: int, budget: int) -> list[list[list[int]]]:
    """Plan and check its invariants: every group once, equal counts, none empty, budget kept
    whenever the count was not capped by the smallest learner share."""
    out = plan(tokens, learners, budget)
    assert len(out) == learners
    flat = sorted(i for mbs in out for m in mbs for i in m)
    assert flat == list(range(len(tokens)))
    counts = {len(mbs) for mbs in out}
    assert len(counts) == 1 and counts.pop() >= 1
    assert all(m for mbs in out for m in mbs)
    cap = min(sum(len(m) for m in mbs) for mbs in out)
    if len(out[0]) < cap:
        for mbs in out:
            for m in mbs:
                assert len(m) == 1 or sum(int(tokens[i]) for i in m) <= budget
    return out


def test_partition_every_item_once_and_parts_non_empty():
    tokens = [5, 1, 1, 1, 9, 3, 2]
    parts = partition(tokens, 3)
    assert sorted(i for p in parts for i in p) == list(range(7))
    assert all(parts) and len(parts) == 3
    assert max(sum(tokens[i] for i in p) for p in parts) == 9  # optimal: 9 cannot share


def test_awkward_counts():
    out = _check_plan([100, 200, 300, 400, 500, 600, 700], 4, 250)
    assert all(len(mbs) == 1 for mbs in out)  # a learner holds one group: the cap is 1
    out = _check_plan([10, 20, 30, 40], 4, 1000)
    assert sorted(m for mbs in out for m in mbs) == [[0], [1], [2], [3]]
    assert _check_plan([7], 1, 3) == [[[0]]]


def test_too_few_groups_raises_with_message():
    msg = "cannot give each of 3 learners a group: the batch has 1; ask for at least 3 groups"
    with pytest.raises(ValueError, match=msg):
        plan([100], 3, 1000)
    with pytest.raises(ValueError, match=msg):
        partition([100], 3)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: partition([1, 2], 0), "parts"),
        (lambda: partition([1, 0, 2], 1), r"tokens\[1\]"),
        (lambda: partition([1, -4], 1), r"tokens\[1\]"),
        (lambda: partition([[1, 2]], 1), "tokens"),
        (lambda: plan([1, 2], 1, 0), "budget"),
        (lambda: micro_batches([1, 2, 3], [0, 1], 3, 10), "count"),
        (lambda: micro_batches([1, 2, 3], [0, 1], 0, 10), "count"),
        (lambda: micro_batches([1, 2, 3], [0, 0], 1, 10), "indices"),
        (lambda: micro_batches([1, 2, 3], [0, 5], 1, 10), "indices"),
        (lambda: imbalance([1, 2], []), "parts"),
    ],
)
def test_errors_name_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_random_plans_hold_the_invariants():
    rng = np.random.default_rng(1234)
    for _ in range(100):
        k = int(rng.integers(1, 9))
        n = int(rng.integers(k, 201))
        tokens = rng.integers(1, 5000, n)
        budget = int(math.exp(rng.uniform(math.log(100), math.log(2 * tokens.sum() / k))))
        _check_plan(tokens, k, budget)


def test_micro_batches_exact_count_none_empty():
    tokens = [9, 8, 7, 6, 5, 4, 3, 2, 1]
    for count in range(1, 10):
        mbs = micro_batches(tokens, list(range(9)), count, budget=15)
        assert len(mbs) == count and all(mbs)
        assert sorted(i for m in mbs for i in m) == list(range(9))


def test_group_over_budget_sits_alone():
    tokens = [100, 5000, 100, 100, 100, 300, 200]
    mbs = micro_batches(tokens, [0, 1, 2, 3, 4], 2, budget=1000)
    assert [1] in mbs
    out = _check_plan(tokens, 1, 1000)
    assert [1] in out[0]
    assert all(sum(tokens[i] for i in m) <= 1000 for m in out[0] if m != [1])
    tokens = [6000, 7000, *range(50, 450, 20)]  # two learners, each with one big group
    out = _check_plan(tokens, 2, 500)
    for mbs in out:
        for m in mbs:
            assert len(m) == 1 or sum(tokens[i] for i in m) <= 500


def test_cap_binds_when_a_learner_has_few_groups():
    tokens = [1000, 1000, 1000, 3000]  # one learner takes 3000 alone: M capped at 1
    out = _check_plan(tokens, 2, 500)
    assert out == [[[0, 1, 2]], [[3]]]  # 3000 tokens over a 500 budget: the documented trade


def test_deterministic():
    tokens = _lognormal_groups(3, groups=97)
    assert plan(tokens, 5, 4096) == plan(tokens.copy(), 5, 4096)
    assert plan(tokens, 5, 4096) == plan(list(map(int, tokens)), 5, 4096)
    assert partition([5, 5, 5, 5], 2) == partition([5, 5, 5, 5], 2) == [[0, 3], [1, 2]]


def test_kk_quality_on_lognormal_groups():
    tokens = _lognormal_groups(0)
    kk = imbalance(tokens, partition(tokens, 4))
    greedy = imbalance(tokens, _greedy(tokens, 4))
    equal = imbalance(tokens, [list(range(j, j + 16)) for j in range(0, 64, 16)])
    print(f"imbalance kk={kk:.6f} greedy={greedy:.6f} equal-counts={equal:.6f}")
    assert kk <= 1.05
    assert kk <= greedy
    assert kk - 1 <= (equal - 1) / 10


def test_imbalance():
    assert imbalance([1, 1, 2], [[0, 1], [2]]) == 1.0
    assert imbalance([3, 1], [[0], [1]]) == 1.5
    assert imbalance([3, 1], [[0, 1], []]) == 2.0


def test_repair_fills_an_empty_part():
    fixed = _repair([(6, [0, 1, 2]), (0, []), (0, [])], [1, 2, 3])
    assert fixed == [(3, [2]), (1, [0]), (2, [1])]
