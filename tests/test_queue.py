"""The FIFO queue over real gloo ranks: every item to exactly one learner, once, in put order."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks

import conduit_dist as cd
from conduit_dist.errors import EmptyStoreError

SPEC = {"id": ((), torch.int64)}


def _drain(rank: int, world: int, placement: str, sampler: str = "queue") -> list[int]:
    plane = cd.DataPlane(
        cd.ExperienceSpec(SPEC), 400, sampler=sampler, placement=placement, schedule="sync"
    )
    got, t = [], 0
    for r in range(30):
        k = rank + 1  # uneven producers: 1, 2, 3 items per round
        plane.put({"id": torch.arange(t, t + k) + 10_000 * rank})
        t += k
        if r >= 3:  # fetch 2 per round per learner: the queue grows, then drains below
            got += plane.fetch(2)["id"].tolist()
    while True:
        try:
            got += plane.fetch(2)["id"].tolist()
        except EmptyStoreError:
            break
    left = len(plane)
    plane.close()
    return [left, *got]


@pytest.mark.parametrize("placement", ["round_robin", "local"])
def test_queue_delivers_every_item_once_in_each_producers_order(placement):
    res = run_ranks(_drain, 3, placement, timeout_s=180)
    put = {10_000 * r + i for r in range(3) for i in range(30 * (r + 1))}
    delivered = [i for got in res.values() for i in got[1:]]
    assert len(delivered) == len(set(delivered)), "an item was delivered twice"
    left = {got[0] for got in res.values()}
    assert len(left) == 1 and left.pop() < 2  # every rank agrees; fewer than a batch remain
    assert len(put - set(delivered)) < 2 and set(delivered) <= put
    for got in res.values():  # each learner sees each producer's items in put order
        for r in range(3):
            mine = [i for i in got[1:] if i // 10_000 == r]
            assert mine == sorted(mine)


def test_queue_at_world_size_one_is_fifo_and_all_or_nothing():
    plane = cd.DataPlane(cd.ExperienceSpec(SPEC), 8, sampler="queue")
    plane.put({"id": torch.arange(5)})
    assert plane.fetch(3)["id"].tolist() == [0, 1, 2]
    with pytest.raises(EmptyStoreError, match="holds 2 untaken items"):
        plane.fetch(3)
    assert len(plane) == 2  # nothing was taken by the refused fetch
    plane.put({"id": torch.arange(5, 12)})  # 9 items in 8 slots: the oldest untaken is evicted
    assert plane.fetch(4)["id"].tolist() == [4, 5, 6, 7]
    assert plane.store_stats()["evictions"] == 1
    plane.close()


def test_queue_takes_the_oldest_across_tiers():
    storage = cd.Tiers([("host", 4), ("host", 8)], gbps={"host": (1.0, 1.0)})
    plane = cd.DataPlane(cd.ExperienceSpec(SPEC), 12, sampler=cd.Fifo(), storage=storage)
    out = []
    for r in range(6):
        plane.put({"id": torch.arange(3 * r, 3 * r + 3)})  # demotes to the second tier
        if r % 2:
            out += plane.fetch(4)["id"].tolist()
    assert out == list(range(12))
    assert plane.store_stats()["taken"] == 12 and plane.store_stats()["evictions"] == 0
    plane.close()


def test_lifo_delivers_every_item_once_over_three_uneven_producers():
    res = run_ranks(_drain, 3, "round_robin", "lifo", timeout_s=180)
    put = {10_000 * r + i for r in range(3) for i in range(30 * (r + 1))}
    delivered = [i for got in res.values() for i in got[1:]]
    assert len(delivered) == len(set(delivered)), "an item was delivered twice"
    assert set(delivered) <= put and len(put - set(delivered)) < 2


@pytest.mark.parametrize("tiers", [None, [("host", 4), ("host", 8)]])
def test_lifo_takes_the_newest_first_on_one_tier_and_across_tiers(tiers):
    storage = cd.Tiers(tiers, gbps={"host": (1.0, 1.0)}) if tiers else None
    plane = cd.DataPlane(cd.ExperienceSpec(SPEC), 12, sampler=cd.Lifo(), storage=storage)
    plane.put({"id": torch.arange(10)})
    assert plane.fetch(3)["id"].tolist() == [9, 8, 7]
    plane.put({"id": torch.arange(10, 12)})  # reuses the freed slots
    assert plane.fetch(6)["id"].tolist() == [11, 10, 6, 5, 4, 3]
    assert len(plane) == 3 and plane.fetch(3)["id"].tolist() == [2, 1, 0]
    assert plane.store_stats()["taken"] == 12 and plane.store_stats()["evictions"] == 0
    plane.close()
