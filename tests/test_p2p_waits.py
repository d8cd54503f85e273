"""Waits on gloo point-to-point works, on real gloo ranks: a peer that is merely slow (a delay
longer than the lazy mark's 50 ms grace) no longer fails the round, on the exchange and on both
planes; a peer that never comes still fails it by name; collectives keep the lazy mark.

A gloo send/recv's timed ``wait`` that expires closes every pair of the group ("Application
timeout caused pair closure"), so it must not get a short first wait as collectives do."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from plane_helpers import assert_intact, make_batch, spec
from test_tokens import check_whole, group_batch, make_spec

import conduit_dist as cd

DELAY_S = 0.3  # six times the 50 ms grace


def _rows(rank: int, world: int, per_peer: int) -> torch.Tensor:
    """``per_peer`` rows of 3 floats for each destination, each row naming its source."""
    n = world * per_peer
    return torch.arange(n * 3, dtype=torch.float32).view(n, 3) + 1000 * rank


def _slow_peer(rank: int, world: int, strategy: str) -> dict[str, object]:
    """Rank 1 starts its side of each exchange DELAY_S late; then one more exchange of the
    same group shows that it is still usable."""
    from conduit_dist.collectives.exchange import Exchange
    from conduit_dist.collectives.strategies import make_strategies

    ex = Exchange(10.0)
    move = make_strategies()[strategy]
    per = 4
    inp, out = _rows(rank, world, per), torch.empty(world * per, 3)
    if rank == 1:
        time.sleep(DELAY_S)
    t0 = time.monotonic()
    move.run(ex, out, inp, [per] * world, [per] * world, 0, "rows", None)
    waited = time.monotonic() - t0
    mine = slice(rank * per, (rank + 1) * per)
    expected = torch.cat([_rows(src, world, per)[mine] for src in range(world)])
    again = torch.empty(world * per, 3)
    ex.all_to_all(again, inp, [per] * world, [per] * world, 1, "rows[check]")
    dist.barrier()  # both ranks done: marks written
    marked = rank not in ex.laggards(0)
    ex.close()
    return {"equal": torch.equal(out, expected) and torch.equal(again, expected),
            "waited": waited, "marked": marked}  # fmt: skip


@pytest.mark.parametrize("strategy", ["p2p", "chunked4", "all_to_all"])
def test_a_slow_peer_does_not_fail_the_exchange_or_close_the_group(strategy):
    res = run_ranks(_slow_peer, 2, strategy, collective_timeout_s=20)
    for rank, r in res.items():
        assert r["equal"], rank
    assert res[0]["waited"] > DELAY_S / 2  # rank 0 really waited past the grace
    assert res[0]["marked"]  # a wait past the grace (or a send/recv wait) marks the round


def _absent_peer(rank: int, world: int) -> dict[str, object] | None:
    """Rank 1 never reaches round 0's point-to-point exchange; rank 0 gives up at the timeout."""
    from conduit_dist.collectives.exchange import Exchange
    from conduit_dist.collectives.strategies import PointToPoint

    timeout_s = 1.0
    ex = Exchange(timeout_s)
    if rank == 1:
        time.sleep(timeout_s + 1.5)  # alive, stalled: never arrives
        return None
    per = 2
    t0 = time.monotonic()
    try:
        PointToPoint(1).run(ex, torch.empty(2 * per, 3), _rows(0, 2, per), [per] * 2, [per] * 2,
                            0, "rows", None)  # fmt: skip
    except cd.RoundError as exc:
        return {"error": str(exc), "ranks": list(exc.ranks), "waited": time.monotonic() - t0}
    return {"error": None}


def test_a_peer_that_never_comes_still_fails_the_send_recv_by_name_at_the_timeout():
    r = run_ranks(_absent_peer, 2, collective_timeout_s=20)[0]
    assert r["error"] is not None
    assert r["ranks"] == [1], r["error"]
    assert "rows[p2p] failed on rank 0" in r["error"] and "timeout 1s" in r["error"], r["error"]
    assert 0.9 < r["waited"] < 3.0, r


def _quick_collectives(rank: int, world: int) -> list[bool]:
    """Quick all-to-alls, one a round: whether this rank marked each (lazy: only past 50 ms)."""
    from conduit_dist.collectives.exchange import Exchange

    ex = Exchange(10.0)
    inp, out = _rows(rank, world, 1), torch.empty(world, 3)
    marked = []
    for rnd in range(5):
        dist.barrier()
        ex.all_to_all(out, inp, [1] * world, [1] * world, rnd, "rows")
        dist.barrier()
        marked.append(rank not in ex.laggards(rnd))
    ex.close()
    return marked


def test_quick_collectives_keep_the_lazy_mark():
    res = run_ranks(_quick_collectives, 2, collective_timeout_s=20)
    for rank, marked in res.items():
        assert not all(marked), (rank, marked)  # at most a stalled one in five writes the store


def _delay_p2p(calls: list[int]) -> None:
    """Make this rank start its side of every point-to-point exchange DELAY_S late."""
    from conduit_dist.collectives.strategies import PointToPoint

    run = PointToPoint.run

    def late(self, ex, out, inp, out_splits, in_splits, *args):
        calls.append(sum(out_splits) + sum(in_splits))
        time.sleep(DELAY_S)
        return run(self, ex, out, inp, out_splits, in_splits, *args)

    PointToPoint.run = late


def _data_plane(rank: int, world: int) -> dict[str, object]:
    """A DataPlane whose rows move point to point, rank 1 late at each exchange."""
    calls: list[int] = []
    if rank == 1:
        _delay_p2p(calls)
    transport = cd.TransportConfig(strategy="p2p", timeout_s=10.0)
    plane = cd.DataPlane(spec(), capacity_per_rank=1000, seed=3, placement="round_robin",
                         schedule="sync", transport=transport)  # fmt: skip
    for it in range(3):
        plane.put(make_batch(rank * 1_000_000 + it * 1_000 + torch.arange(20)))
        assert_intact(plane.fetch(8))
    plane.close()
    return {"calls": calls}


def _token_plane(rank: int, world: int) -> dict[str, object]:
    """A TokenPlane whose producer (rank 1) sends its groups point to point, late."""
    calls: list[int] = []
    if rank == 1:
        _delay_p2p(calls)
    transport = cd.TransportConfig(strategy="p2p", timeout_s=10.0)
    with cd.TokenPlane(make_spec(), 64, 8192, learner_ranks=[0], transport=transport) as tp:
        tp.put(*group_batch([rank * 10, rank * 10 + 1]))
        if rank == 0:
            return {"seen": sorted(check_whole(tp.fetch(4, 400))), "calls": calls}
        tp.flush()
        return {"seen": [], "calls": calls}


def test_a_data_plane_with_a_slow_peer_delivers_over_point_to_point():
    res = run_ranks(_data_plane, 2, collective_timeout_s=20)
    assert any(res[1]["calls"])  # rows really moved point to point, late


def test_a_token_plane_with_a_slow_producer_delivers_over_point_to_point():
    res = run_ranks(_token_plane, 2, collective_timeout_s=20)
    assert res[0]["seen"] == [0, 1, 10, 11]
    assert any(res[1]["calls"])
