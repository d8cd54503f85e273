"""The first loop a TorchRL or DataLoader user writes, as they write it, and the signals that
replace the first-hour surprises (a fetch larger than the store, reserved keys, keyword-only
arguments, grouped transport settings)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks
from plane_helpers import assert_intact, make_batch, spec

import conduit_dist as cd

LEARNING_STARTS, ITERS, B = 64, 6, 32


def _first_loop(rank: int, world: int, per_put: int) -> dict[str, object]:
    """The issue's loop verbatim: context manager, warm-up by ``len(plane)``, put + fetch."""
    counter = iter(range(10_000))

    def collect() -> dict[str, torch.Tensor]:
        ids = torch.tensor([rank * 100_000 + next(counter) for _ in range(per_put)])
        return make_batch(ids)

    warm_puts, fetched = 0, []
    with cd.DataPlane(spec(), capacity_per_rank=1000) as plane:
        while len(plane) < LEARNING_STARTS:
            plane.put(collect())
            warm_puts += 1
        for _it in range(ITERS):
            plane.put(collect())
            batch = plane.fetch(B)
            assert_intact(batch)
            fetched.append(batch["id"].shape[0])
        stored = plane.stored
    assert plane.closed
    return {"warm_puts": warm_puts, "fetched": fetched, "stored": stored}


@pytest.mark.parametrize("world", [1, 2])
def test_the_first_loop_as_users_write_it(world):
    # rank 1 puts smaller batches: its warm-up takes more puts, and still ends
    res = {0: _first_loop(0, 1, 8)} if world == 1 else run_ranks(_first_loop_uneven, world)
    for rank, r in res.items():
        per_put = 8 if rank == 0 else 4
        assert r["warm_puts"] == LEARNING_STARTS // per_put  # len() counted this rank's puts
        assert r["fetched"] == [B] * ITERS
    total = sum(r["warm_puts"] * (8 if k == 0 else 4) + ITERS * (8 if k == 0 else 4)
                for k, r in res.items())  # fmt: skip
    assert all(r["stored"] == total for r in res.values())  # every put stored once


def _first_loop_uneven(rank: int, world: int) -> dict[str, object]:
    return _first_loop(rank, world, 8 if rank == 0 else 4)


def test_len_counts_staged_items_and_stored_counts_rounds():
    with cd.DataPlane(spec(), capacity_per_rank=10, schedule="sync") as plane:
        plane.put(make_batch(torch.arange(4)))
        assert (len(plane), plane.stored) == (4, 0)  # staged here, no round yet
        plane.flush()
        assert (len(plane), plane.stored) == (4, 4)
        plane.put(make_batch(torch.arange(4, 20)))
        assert len(plane) == 10  # at most the capacity: the oldest are evicted by the round


def test_fetch_larger_than_the_store_says_so():
    with cd.DataPlane(spec(), capacity_per_rank=100, schedule="sync") as plane:
        plane.put(make_batch(torch.arange(4)))
        with pytest.raises(cd.EmptyStoreError, match=r"holds 4 item\(s\) .* oversample=True"):
            plane.fetch(256)
        batch = plane.fetch(256, oversample=True)  # explicit: rows repeat
        assert batch["id"].shape[0] == 256 and set(batch["id"].tolist()) <= {0, 1, 2, 3}
        assert plane.fetch(4)["id"].shape[0] == 4  # as many as stored: fine


def test_fetch_without_meta_leaves_reserved_keys_out():
    with cd.DataPlane(spec(), capacity_per_rank=100, sampler="prioritized") as plane:
        plane.put(make_batch(torch.arange(16)))
        full = plane.fetch(8)
        plain = plane.fetch(8, meta=False)
    assert {"_version", "_index", "_weight"} <= set(full)
    assert set(plain) == set(make_batch(torch.arange(1)))
    with cd.DataPlane(spec(), capacity_per_rank=10) as plane:
        plane.put(make_batch(torch.arange(4)))
        with pytest.raises(cd.ConfigError, match="fetch meta: expected True or False, got 0"):
            plane.fetch(2, meta=0)


def test_arguments_after_capacity_are_keyword_only_and_transport_is_one_object():
    with pytest.raises(TypeError, match="positional"):
        cd.DataPlane(spec(), 100, 7)
    with pytest.raises(cd.ConfigError, match=r"transport.timeout_s: .* got 0"):
        cd.TransportConfig(timeout_s=0)
    with pytest.raises(cd.ConfigError, match=r"transport.strategy: expected one of .* 'fast'"):
        cd.TransportConfig(strategy="fast")
    with pytest.raises(cd.ConfigError, match=r"transport: expected a conduit_dist.Transport"):
        cd.DataPlane(spec(), 100, transport={"timeout_s": 5})
    with cd.DataPlane(spec(), 100, transport=cd.TransportConfig(timeout_s=5)) as plane:
        assert plane._p.exchange.timeout.total_seconds() == 5


def _publish_on_every_learner(rank: int, world: int) -> tuple[int, int, list[int], int]:
    with cd.DataPlane(spec(), capacity_per_rank=10) as plane:
        net = torch.nn.Linear(2, 2)
        version = plane.publish_weights(net)
        plane.put(make_batch(torch.arange(rank * 10, rank * 10 + 4)))
        plane.fetch(4)
        last = plane._p.weights.last
        pulled = plane.pull_weights(net)  # its own version, whole
    return version, last.sent + last.received, list(last.owners), pulled


def test_every_learner_holds_its_version_and_without_actors_nothing_moves():
    res = run_ranks(_publish_on_every_learner, 2)
    assert res == {0: (1, 0, [0, 1], 1), 1: (1, 0, [0, 1], 1)}
