"""One-exchange rounds (local placement, uniform sampling) and payloads averaged inside them, on
real gloo ranks: the batch stays exactly uniform, a grown fetch falls back to the full delivery,
and learners' averaged payloads are bitwise identical."""

from __future__ import annotations

import math
import time

import pytest
import torch
from dist_utils import run_ranks
from plane_helpers import assert_intact, make_batch, spec

from conduit_dist.errors import ConfigError, RoundError


def _plane(numel: int = 0, **kw):
    import conduit_dist as cd

    args = dict(placement="local", schedule="sync", reduce_numel=numel)
    return cd.DataPlane(spec(), 1000, seed=3, **{**args, **kw})


def _uniform_over_uneven_shards(rank, world):
    plane = _plane()
    ex = plane._p.exchange
    puts = [10, 30, 0][rank]  # uneven producers; rank 2 puts nothing
    base = 1000 * rank
    for r in range(4):
        if puts:
            plane.put(make_batch(torch.arange(base + r * puts, base + (r + 1) * puts)))
        plane.fetch(64) if r else plane.flush()
    calls, ids = [], []
    for _ in range(150):
        ex.record = []
        batch = plane.fetch(64)
        calls.append(len(ex.record))
        assert_intact(batch)
        ids.append(batch["id"].clone())
    ex.record = None
    fused = plane._p.engine.from_candidates
    sizes = plane.sizes.tolist()
    plane.close()
    return torch.cat(ids).tolist(), calls, fused, sizes


def test_fused_rounds_run_one_exchange_and_stay_uniform_over_uneven_shards():
    res = run_ranks(_uniform_over_uneven_shards, 3, timeout_s=120)
    sizes = res[0][3]
    assert sizes == [40, 120, 0]
    n = sum(sizes)
    for rank, (ids, calls, fused, _) in res.items():
        assert set(calls) == {1}, calls  # meta, ingestion and delivery in one all-to-all
        assert fused >= 150
        counts: dict[int, int] = {}
        for i in ids:
            counts[i] = counts.get(i, 0) + 1
        assert len(counts) == n  # every stored item can be drawn, nothing else is
        expected = len(ids) / n
        chi2 = sum((counts.get(i, 0) - expected) ** 2 / expected for i in counts)
        df = n - 1
        assert chi2 < df + 5 * math.sqrt(2 * df), (rank, chi2, df)  # ~5 sigma
        from_shard0 = sum(c for i, c in counts.items() if i < 1000) / len(ids)
        assert abs(from_shard0 - 40 / 160) < 5 * math.sqrt(0.25 * 0.75 / len(ids))


def _grown_fetch(rank, world):
    plane = _plane()
    ex = plane._p.exchange
    plane.put(make_batch(torch.arange(100 * rank, 100 * rank + 50)))
    plane.fetch(16)
    plane.put(make_batch(torch.arange(100 * rank + 50, 100 * rank + 60)))
    plane.fetch(16)
    before = plane._p.engine.from_candidates
    ex.record = []
    grown = plane.fetch(64)  # more than each shard sent as candidates: the full delivery runs
    ncalls = len(ex.record)
    ex.record = None
    after = plane._p.engine.from_candidates
    again = plane.fetch(64)
    assert_intact(grown)
    assert_intact(again)
    out = (grown["id"].shape[0], ncalls, after - before, plane._p.engine.from_candidates - after)
    plane.close()
    return out


def test_a_fetch_larger_than_last_round_falls_back_to_the_full_delivery():
    res = run_ranks(_grown_fetch, 2)
    for rows, ncalls, fused_then, fused_next in res.values():
        assert rows == 64
        assert ncalls == 2  # the fused exchange, then the ordinary delivery
        assert (fused_then, fused_next) == (0, 1)


def _average(rank, world, placement):
    plane = _plane(numel=5, placement=placement)
    plane.put(make_batch(torch.arange(10 * rank, 10 * rank + 10)))
    plane.flush()
    payload = torch.arange(5, dtype=torch.float32) * (rank + 1) + 0.1 * rank
    plane.fetch(8, reduce=payload)  # every learner passes one: the mean
    first = payload.clone()
    other = torch.full((5,), float(rank))
    plane.fetch(8, reduce=other) if rank != 1 else plane.fetch(8)  # rank 1 passes none
    errors = []
    for bad in (torch.zeros(4), torch.zeros(5, dtype=torch.float64), torch.zeros(10)[::2]):
        try:
            plane.fetch(8, reduce=bad)
        except ConfigError as exc:
            errors.append(str(exc))
    plane.close()
    return first.tolist(), other.tolist(), errors


@pytest.mark.parametrize("placement", ["local", "round_robin"])
def test_payloads_are_averaged_inside_the_round_identically_on_every_learner(placement):
    """The fused schedule's one exchange, or the general schedule's header exchange."""
    res = run_ranks(_average, 3, placement)
    payloads = [torch.arange(5, dtype=torch.float32) * (r + 1) + 0.1 * r for r in range(3)]
    mean = torch.stack(payloads).sum(0) / 3
    firsts = [res[r][0] for r in range(3)]
    assert firsts[0] == firsts[1] == firsts[2]  # bitwise identical
    assert torch.allclose(torch.tensor(firsts[0]), mean)
    assert res[0][1] == res[2][1] == [1.0] * 5  # the mean of ranks 0 and 2 only
    for _, _, errors in res.values():
        assert len(errors) == 3
        assert all("expected a contiguous cpu float32 tensor of shape (5,)" in e for e in errors)


def _average_without_extension(rank, world):
    from conduit_dist.rounds import wire

    wire._native = None  # a checkout that was not built: torch's copies and mean
    plane = _plane(numel=5, placement="local")
    plane.put(make_batch(torch.arange(10 * rank, 10 * rank + 10)))
    plane.flush()
    payload = torch.randn(5, generator=torch.Generator().manual_seed(rank))
    batch = plane.fetch(8, reduce=payload)
    errors = []
    odd = torch.frombuffer(bytearray(24), dtype=torch.float32, offset=1, count=5)
    with torch.inference_mode():
        frozen = torch.zeros(5)
    for bad in (torch.zeros(5, requires_grad=True), odd, frozen):
        try:
            plane.fetch(8, reduce=bad)
        except ConfigError as exc:
            errors.append(str(exc))
    changed = torch.zeros(5)
    plane.fetch_start(8, reduce=changed)
    changed.requires_grad_(True)  # while its round is in flight: refused where it is averaged
    try:
        plane.fetch(8)
    except RoundError as exc:  # the plane is failed: the round could not complete its average
        errors.append(str(exc))
    plane.close()
    return payload.view(torch.int32).tolist(), batch["id"].shape[0], errors


def test_payloads_average_without_the_extension_and_bad_payloads_are_refused():
    res = run_ranks(_average_without_extension, 2)
    a, b = (torch.randn(5, generator=torch.Generator().manual_seed(r)) for r in range(2))
    want = a.add(b).mul(0.5).view(torch.int32).tolist()  # the extension's mean2_f32 bits too
    for got, rows, errors in res.values():
        assert got == want and rows == 8
        assert "does not require grad" in errors[0]
        assert "expected float32 data aligned to 4 bytes" in errors[1]
        assert "got an inference tensor" in errors[2]
        assert "does not require grad" in errors[3] and len(errors) == 4


def _replicas(rank, world):
    from conduit_dist.rl.dqn import DQN
    from conduit_dist.train.config import AlgoConfig

    torch.manual_seed(0)  # the same initial weights on both ranks
    agent = DQN(AlgoConfig(hidden=[16]), 4, 2, flat_grads=True)
    torch.manual_seed(rank + 1)  # different data per rank
    example = {
        "obs": torch.zeros(1, 4),
        "action": torch.zeros(1, dtype=torch.int64),
        "reward": torch.zeros(1),
        "next_obs": torch.zeros(1, 4),
        "done": torch.zeros(1, dtype=torch.bool),
    }
    import conduit_dist as cd

    plane = cd.DataPlane(
        cd.ExperienceSpec.from_batch(example), 500, placement="local", schedule="sync",
        reduce_numel=agent.flat.numel(),
    )  # fmt: skip
    pending = False
    for _ in range(30):
        n = 8
        plane.put({
            "obs": torch.randn(n, 4), "action": torch.randint(2, (n,)), "reward": torch.randn(n),
            "next_obs": torch.randn(n, 4), "done": torch.rand(n) < 0.1,
        })  # fmt: skip
        batch = plane.fetch(16, reduce=agent.flat) if pending else plane.fetch(16)
        if pending:
            agent.step()
        agent.loss(batch).backward()
        pending = True
    plane.close()
    flat = torch.cat([p.detach().reshape(-1) for p in agent.q.parameters()])
    return flat.numpy().tobytes(), agent.steps


def test_dqn_replicas_updated_from_round_averaged_gradients_stay_bitwise_identical():
    res = run_ranks(_replicas, 2)
    assert res[0][1] == res[1][1] == 29
    assert res[0][0] == res[1][0]


def _bad_reduce(rank, world, kwargs):
    try:
        _plane(numel=4, **kwargs).close()
    except ConfigError as exc:
        return str(exc)
    return None


def test_reduce_needs_a_sync_round():
    """(On CUDA planes too: the payload rides host rows, see tests/test_round_devices.py.)"""
    expected = "expected schedule='sync'"
    res = run_ranks(_bad_reduce, 2, {"schedule": "overlap"})
    assert all(expected in (msg or "") for msg in res.values()), res


def _early(rank, world):
    plane = _plane(numel=3)
    base = 1000 * rank
    plane.put(make_batch(torch.arange(base, base + 20)))
    plane.fetch(16)  # establishes the request
    payload = torch.full((3,), float(rank + 1))
    plane.fetch_start(16, reduce=payload)  # the exchange is in flight from here
    plane.put(make_batch(torch.arange(base + 20, base + 40)))  # staged for the round after
    errors = []
    for call in (lambda: plane.fetch_start(16), lambda: plane.fetch_start(0)):
        try:
            call()
        except ConfigError as exc:
            errors.append(str(exc))
    batch = plane.fetch(16)
    assert_intact(batch)
    early_ids = batch["id"].tolist()
    lag = plane.last_fetch.lag_rounds
    after = plane.fetch(16)  # the next round sees the items put during the flight
    sizes = plane.sizes.tolist()
    plane.fetch_start(16)  # left in flight: close() finishes it as the closing round
    plane.close()
    return early_ids, lag, payload.tolist(), errors, sizes, after["id"].shape[0]


def test_an_early_started_round_overlaps_puts_and_finishes_at_the_next_fetch():
    res = run_ranks(_early, 2)
    for ids, lag, payload, errors, sizes, n_after in res.values():
        assert all(i % 1000 < 20 for i in ids), ids  # items put during the flight are not in it
        assert lag == 1  # and the batch says so
        assert payload == [1.5, 1.5, 1.5]  # averaged when the round finished
        assert "a round is in flight already" in errors[0] and "batch_size" in errors[1]
        assert sizes == [40, 40] and n_after == 16


def _early_refused(rank, world, kwargs):
    plane = _plane(**kwargs)
    plane.put(make_batch(torch.arange(10 * rank, 10 * rank + 10)))
    try:
        plane.fetch_start(8)
    except ConfigError as exc:
        return str(exc)
    finally:
        plane.close()
    return None


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"placement": "round_robin"}, "needs one-exchange rounds"),
        ({"schedule": "overlap"}, "sync"),
    ],
)
def test_fetch_start_needs_a_fused_sync_plane(kwargs, expected):
    res = run_ranks(_early_refused, 2, kwargs)
    assert all(expected in (msg or "") for msg in res.values()), res


def _small_records(rank, world):
    import conduit_dist as cd

    spec_ = cd.ExperienceSpec.from_batch({"x": torch.zeros(1)})  # an 8-byte record: h > 1
    plane = cd.DataPlane(spec_, 100, placement="local", schedule="sync")
    vals = []
    for r in range(5):
        plane.put({"x": torch.arange(4, dtype=torch.float32) + 100 * rank + 10 * r})
        vals.append(plane.fetch(6)["x"].clone())
    fused, h = plane._p.engine.from_candidates, plane._p.engine.headers.layout.h
    plane.close()
    return torch.cat(vals).tolist(), fused, h


def test_records_smaller_than_a_header_take_several_header_rows():
    res = run_ranks(_small_records, 2)
    stored = {100 * r + 10 * k + i for r in range(2) for k in range(5) for i in range(4)}
    for vals, fused, h in res.values():
        assert h > 1 and fused >= 3
        assert set(vals) <= {float(v) for v in stored}


def _reduce_after_start(rank, world):
    plane = _plane(numel=2)
    plane.put(make_batch(torch.arange(10 * rank, 10 * rank + 10)))
    plane.fetch(4)
    plane.fetch_start(4)
    try:
        plane.fetch(4, reduce=torch.zeros(2))
    except ConfigError as exc:
        msg = str(exc)
    else:
        msg = None
    plane.fetch(4)
    plane.close()
    return msg


def test_a_payload_given_to_the_fetch_of_a_started_round_is_refused():
    for msg in run_ranks(_reduce_after_start, 2).values():
        assert msg is not None and "pass reduce to fetch_start" in msg


def _remote_learner_holds(rank, world):
    # rank 0 learns and stores nothing (local placement, it never puts): its whole batch is the
    # peer's candidates, delivered as a view of the received rows, with no copy
    plane = _plane(learner_ranks=[0])
    held, copies = [], []
    for r in range(12):
        if rank == 1:
            plane.put(make_batch(torch.arange(100 * r, 100 * r + 100)))
            plane.flush()
            continue
        if r == 0:
            plane.flush()
            continue
        batch = plane.fetch(32)
        assert_intact(batch)
        held.append(batch)  # held across the later rounds: their receives must not reuse it
        copies.append({k: v.clone() for k, v in batch.items()})
    fused = plane._p.engine.from_candidates
    pool = plane._p.engine.headers.layout._recv.buffers()  # the header exchange receive buffers
    received = {b.untyped_storage().data_ptr() for b in pool}
    plane.close()
    if rank == 1:
        return None
    assert held[-1]["id"].untyped_storage().data_ptr() in received  # no copy of the batch
    for batch, copy in zip(held, copies):
        assert_intact(batch)
        for k, v in copy.items():
            assert torch.equal(batch[k], v), f"a held batch's field {k} changed"
    ptrs = {b["id"].untyped_storage().data_ptr() for b in held}
    return fused, len(ptrs), len(held)


def test_a_remote_learners_batch_is_the_received_rows_and_stays_intact_while_held():
    fused, buffers, batches = run_ranks(_remote_learner_holds, 2, timeout_s=120)[0]
    assert fused >= 10  # every fetch came from the header exchange's candidates
    assert buffers == batches  # each held batch on its own receive buffer: none was reused


def _hidden(rank, world, shared_memory):
    import conduit_dist as cd

    plane = _plane(transport=cd.TransportConfig(shared_memory=shared_memory))
    plane.put(make_batch(torch.arange(1000 * rank, 1000 * rank + 20)))
    plane.fetch(8)
    hidden = []
    for _ in range(3):
        torch.distributed.barrier()
        if rank == 1:
            time.sleep(0.01)  # the last to arrive: rank 0's exchange runs ~10 ms behind it
        plane.fetch_start(8)
        time.sleep(0.1)  # the caller's work: no put, so nothing polls the exchange
        plane.fetch(8)
        hidden.append(plane.last_fetch.hidden_ms)
    plane.close()
    return hidden


def test_an_early_round_over_shared_memory_counts_its_exchange_as_hidden_when_it_ended_unseen():
    """Over shared memory the barrier stamps each rank's arrival, so an exchange that completed
    while the caller worked counts as hidden up to the last rank's arrival even though no put
    saw it in flight (the last rank itself waited for nobody: 0); over gloo the count stays the
    lower bound of the last sighting (none here: 0)."""
    res = run_ranks(_hidden, 2, True)
    assert all(0.5 < h < 100 for h in res[0]), res  # ~10 ms, ended long before the fetch
    assert res[1] == [0.0, 0.0, 0.0], res
    for hidden in run_ranks(_hidden, 2, False).values():
        assert hidden == [0.0, 0.0, 0.0], hidden
