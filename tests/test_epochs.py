"""Sampling without replacement over real gloo ranks: epochs visit every item once; rollouts go
to one learner each, ``epochs`` times, then leave the store."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from dist_utils import run_ranks

import conduit_dist as cd
from conduit_dist.errors import ConfigError, EmptyStoreError

SPEC = {"id": ((), torch.int64)}


def _rollouts(rank: int, world: int, shuffle: str, placement: str) -> list[list[int]]:
    plane = cd.DataPlane(
        cd.ExperienceSpec(SPEC),
        64,
        sampler=cd.WithoutReplacement(epochs=3, shuffle=shuffle),
        placement=placement,
        schedule="sync",
        max_lag=0,
    )
    out = []
    for it in range(2):
        k = 4 * (rank + 1)  # uneven producers: 4, 8, 12 items (24 a rollout)
        plane.put({"id": torch.arange(k) + 1000 * rank + 100 * it})
        epoch_items = []
        for _ in range(3 * 2):  # 3 epochs x 2 minibatches of 4 per learner (8 items each)
            epoch_items += plane.fetch(4, more=True)["id"].tolist()
        out.append(epoch_items)
        assert len(plane) == 0, "the rollout's items left the store after its epochs"
    with pytest.raises(EmptyStoreError, match="store is empty"):
        plane.fetch(4)
    plane.put({"id": torch.arange(2) + 5000 * rank})  # 6 items: fewer than 3 learners x 4
    with pytest.raises(EmptyStoreError, match="positions are left in this learner's stream"):
        plane.fetch(4)
    assert len(plane) == 6  # nothing taken
    plane.close()
    return out


@pytest.mark.parametrize("shuffle,placement", [("local", "local"), ("global", "round_robin")])
def test_rollout_epochs_give_each_item_to_one_learner_once_per_epoch(shuffle, placement):
    res = run_ranks(_rollouts, 3, shuffle, placement, timeout_s=180)
    for it in range(2):
        put = {1000 * r + 100 * it + i for r in range(3) for i in range(4 * (r + 1))}
        per_epoch = [Counter() for _ in range(3)]
        for got in res.values():
            items = got[it]
            assert len(items) == 24
            for e in range(3):
                per_epoch[e].update(items[8 * e : 8 * e + 8])
        for e in range(3):  # every item exactly once per epoch over all learners
            assert set(per_epoch[e]) == put and max(per_epoch[e].values()) == 1
        if shuffle == "local":  # each learner keeps its block: the same 8 items every epoch
            for got in res.values():
                blocks = [set(got[it][8 * e : 8 * e + 8]) for e in range(3)]
                assert blocks[0] == blocks[1] == blocks[2]
                orders = [got[it][8 * e : 8 * e + 8] for e in range(3)]
                assert orders[0] != orders[1] or orders[1] != orders[2]  # reshuffled


def test_endless_epochs_skip_overwritten_items_and_keep_the_rest():
    plane = cd.DataPlane(cd.ExperienceSpec(SPEC), 10, sampler=cd.WithoutReplacement())
    plane.put({"id": torch.arange(10)})
    first = plane.fetch(5)["id"].tolist()
    plane.put({"id": torch.arange(10, 13)})  # overwrites items 0, 1, 2
    rest = plane.fetch(5 - sum(i < 3 for i in set(range(10)) - set(first)))["id"].tolist()
    assert sorted(first + rest) == sorted(set(range(10)) - ({0, 1, 2} - set(first)))
    assert plane.store_stats()["skipped"] == len({0, 1, 2} - set(first))
    second = plane.fetch(10)["id"].tolist()  # the next epoch: what is stored now, once each
    assert sorted(second) == list(range(3, 13))
    assert len(plane) == 10  # endless epochs take nothing


def test_an_epoch_tail_is_dropped_and_counted_and_the_next_pass_starts():
    """10 items, fetches of 3: each epoch's last item is dropped (drop_last), the pass ends
    after its epochs, the rollout leaves the store, and the next pass serves new items."""
    plane = cd.DataPlane(cd.ExperienceSpec(SPEC), 32, sampler=cd.WithoutReplacement(2))
    plane.put({"id": torch.arange(10)})
    got = [plane.fetch(3)["id"].tolist() for _ in range(6)]  # 2 epochs x 3 fetches
    for e in range(2):
        epoch = [i for batch in got[3 * e : 3 * e + 3] for i in batch]
        assert len(set(epoch)) == 9 and set(epoch) <= set(range(10))
    assert plane.store_stats()["dropped"] == 2 and len(plane) == 0
    plane.put({"id": torch.arange(10, 13)})
    assert sorted(plane.fetch(3)["id"].tolist()) == [10, 11, 12]
    plane.close()


def test_without_replacement_state_round_trip_continues_the_epoch(tmp_path):
    def run(restore):
        plane = cd.DataPlane(cd.ExperienceSpec(SPEC), 16, sampler=cd.WithoutReplacement(2))
        plane.put({"id": torch.arange(12)})
        a = plane.fetch(4)["id"].tolist()
        path = tmp_path / "wr.pt"
        torch.save(plane.state_dict(), path)
        if restore:
            plane.close()
            plane = cd.DataPlane(cd.ExperienceSpec(SPEC), 16, sampler=cd.WithoutReplacement(2))
            plane.load_state_dict(torch.load(path, weights_only=True))
        b = [plane.fetch(4)["id"].tolist() for _ in range(5)]
        plane.close()
        return a, b

    assert run(False) == run(True)


def test_without_replacement_refuses_bad_settings():
    with pytest.raises(ConfigError, match="epochs: expected >= 1"):
        cd.WithoutReplacement(epochs=0)
    with pytest.raises(ConfigError, match="shuffle: expected one of"):
        cd.WithoutReplacement(shuffle="none")
