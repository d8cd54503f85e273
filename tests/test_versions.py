"""Policy versions over real gloo ranks: every item carries its producer's version, and
``max_policy_age`` never lets an older item reach a learner."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks

import conduit_dist as cd
from conduit_dist.errors import ConfigError, SpecError, StaleDataError

SPEC = {"id": ((), torch.int64)}


def test_items_carry_the_version_their_producer_acted_with():
    plane = cd.DataPlane(cd.ExperienceSpec(SPEC), 32, sampler="queue")
    net = torch.nn.Linear(2, 2)
    plane.put({"id": torch.arange(2)})  # before any weights: version 0
    assert plane.publish_weights(net) == 1
    plane.put({"id": torch.arange(2, 4)})  # after publishing: the published version
    plane.put({"id": torch.arange(4, 6)}, version=7)
    with plane.staged(2, version=3) as rows:
        assert "_version" not in rows  # the plane writes it
        rows["id"][:] = torch.arange(6, 8)
    out = plane.fetch(8)
    assert out["id"].tolist() == list(range(8))
    assert out["_version"].tolist() == [0, 0, 1, 1, 7, 7, 3, 3]
    with pytest.raises(ConfigError, match="put version: expected an int >= 0, got -1"):
        plane.put({"id": torch.arange(2)}, version=-1)
    with pytest.raises(SpecError, match="unexpected \\['_version'\\]"):
        plane.put({"id": torch.arange(2), "_version": torch.zeros(2, dtype=torch.int64)})
    assert len(plane) == 0
    plane.close()


def _bounded(rank: int, world: int, placement: str, sampler: str, lag: int) -> dict[str, object]:
    plane = cd.DataPlane(
        cd.ExperienceSpec(SPEC),
        256,
        sampler=sampler,
        placement=placement,
        schedule="sync",
        max_policy_age=2,
    )
    net = torch.nn.Linear(2, 2)
    ages, version = [], 0
    for it in range(40):
        # rank 2 may be a laggard producer: it acts with weights `lag` versions old
        v = max(version - lag, 0) if rank == 2 else version
        plane.put({"id": torch.arange(4) + 1000 * it + 100_000 * rank}, version=v)
        if it >= 2:
            try:
                out = plane.fetch(2)
            except StaleDataError:  # refused, never returned: counted by the test
                ages.append(-1)
                continue
            ages += (version - out["_version"]).tolist()  # the test's own version counter
        else:
            plane.flush()
        version = plane.publish_weights(net)  # every learner: one version per iteration
    stats = plane.store_stats()
    sizes = plane.sizes.tolist()
    plane.close()
    return {"ages": ages, "evicted": stats["stale_evicted"], "sizes": sizes}


@pytest.mark.parametrize(
    "placement,sampler,lag",
    [("local", "uniform", 3), ("local", "queue", 3), ("round_robin", "uniform", 0)],
)
def test_max_policy_age_never_delivers_an_older_item(placement, sampler, lag):
    """Each shard's items in version order (a laggard alone on its shard under local
    placement, or producers in step): the shards evict every stale item, no fetch refuses."""
    res = run_ranks(_bounded, 3, placement, sampler, lag, timeout_s=180)
    ages = [a for r in res.values() for a in r["ages"]]
    assert len(ages) == 3 * 38 * 2 and min(ages) >= 0, "a fetch was refused"
    assert max(ages) <= 2, "an item older than max_policy_age reached a learner"
    assert sum(r["evicted"] for r in res.values()) > 0  # old items were evicted
    assert len({tuple(r["sizes"]) for r in res.values()}) == 1  # every rank agrees on sizes


def test_interleaved_versions_are_refused_at_the_learner_never_delivered():
    """A laggard's items spread over every shard sit behind fresh ones: the shards cannot evict
    them all, and every fetch that would return one raises instead."""
    res = run_ranks(_bounded, 3, "round_robin", "uniform", 3, timeout_s=180)
    ages = [a for r in res.values() for a in r["ages"]]
    assert -1 in ages  # some fetches were refused
    assert max(ages) <= 2, "an item older than max_policy_age reached a learner"


def test_a_stale_put_is_dropped_and_a_stale_item_behind_a_fresh_one_refused():
    plane = cd.DataPlane(cd.ExperienceSpec(SPEC), 16, max_policy_age=1)
    net = torch.nn.Linear(2, 2)
    for _ in range(4):
        plane.publish_weights(net)  # version 4
    plane.put({"id": torch.arange(4)}, version=2)  # stale already: dropped at ingestion
    plane.put({"id": torch.arange(4, 8)})  # version 4: fresh
    plane.fetch(4)
    assert len(plane) == 4 and plane.store_stats()["stale_evicted"] == 4
    plane.put({"id": torch.arange(8, 16)}, version=3)  # fresh now, behind version-4 items
    plane.fetch(4)
    plane.publish_weights(net)  # version 5: the version-3 items are stale, behind fresh ones
    with pytest.raises(StaleDataError, match="versions 3..3, older than the newest version 5"):
        for _ in range(20):  # uniform draws reach one of the stale items within a few fetches
            plane.fetch(8)
    assert plane.fetch(1, max_policy_age=9)["_version"].numel() == 1  # a looser bound passes
    plane.close()


def test_max_policy_age_refuses_bad_values():
    with pytest.raises(ConfigError, match="max_policy_age: expected None or an int >= 0"):
        cd.DataPlane(cd.ExperienceSpec(SPEC), 16, max_policy_age=-1)


def _disaggregated(rank: int, world: int, schedule: str) -> list[int]:
    """Learner 0 publishes every round; actors act with what they pulled (one round behind)."""
    plane = cd.DataPlane(
        cd.ExperienceSpec(SPEC), 64, learner_ranks=[0], schedule=schedule, max_policy_age=2
    )
    net, ages, version = torch.nn.Linear(2, 2), [], 0
    for it in range(40):
        if rank == 0:
            if it >= 3:
                try:
                    out = plane.fetch(4)
                    ages += (version - out["_version"]).tolist()
                except StaleDataError:
                    ages.append(-1)
            else:
                plane.flush()
            version = plane.publish_weights(net)
        else:
            plane.put({"id": torch.arange(4) + 1000 * it + 100_000 * rank})
            plane.flush()
            plane.pull_weights(net)
    plane.close()
    return ages


@pytest.mark.parametrize("schedule", ["sync", "overlap"])
def test_disaggregated_actors_one_round_behind_are_not_refused(schedule):
    """A version the learner publishes reaches the actors one round later, and with it the bound
    their shards evict by: the learner checks against what every rank knew, so no fetch is
    refused and no item is older than max_policy_age + 1 of the learner's own version."""
    ages = run_ranks(_disaggregated, 3, schedule, timeout_s=120)[0]
    assert len(ages) == 37 * 4 and min(ages) >= 0, "a fetch was refused"
    assert max(ages) <= 3


def _full_ring(rank: int, world: int, placement: str) -> tuple[int, int]:
    """A full ring, items put in version order (every rank learns and publishes in step), put
    written ahead over the oldest slots: the shards evict every stale item, no fetch refuses."""
    plane = cd.DataPlane(
        cd.ExperienceSpec(SPEC), 300, seed=2, placement=placement, schedule="sync",
        max_policy_age=1,
    )  # fmt: skip
    net, refused = torch.nn.Linear(2, 2), 0
    for it in range(30):
        if it % 2 == 0:
            plane.publish_weights(net)  # 128 items a version; the ring holds ~2.3 versions
        plane.put({"id": torch.arange(64) + 1000 * it + 1_000_000 * rank})
        try:
            plane.fetch(32)
        except StaleDataError:
            refused += 1
    evicted = plane.store_stats()["stale_evicted"]
    plane.close()
    return refused, evicted


@pytest.mark.parametrize("world", [1, 2])
def test_a_full_ring_written_ahead_evicts_its_stale_items(world):
    res = run_ranks(_full_ring, 2, "local") if world == 2 else {0: _full_ring(0, 1, "local")}
    for refused, evicted in res.values():
        assert refused == 0 and evicted > 0, res
