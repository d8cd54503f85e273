"""Step-phase scheduler: overlap returns the batches sync returns, lag rules, hooks, accounting."""

from __future__ import annotations

import time

import pytest
import torch
from dist_utils import run_ranks
from plane_helpers import assert_intact, make_batch, spec

import conduit_dist as cd


def _ids(rank: int, it: int, n: int) -> torch.Tensor:
    return rank * 1_000_000 + it * 1_000 + torch.arange(n)


class SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: a learner with a long backward pass."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class Learner(torch.nn.Module):
    def __init__(self, slow: float = 0.0) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)
        self.slow = slow

    def forward(self, x):
        return SlowBackward.apply(self.lin(x), self.slow)


def _train_step(model, batch):
    model(batch["obs"]).sum().backward()


def _off_policy(rank, world, schedule):
    """max_lag=1: overlap puts before fetch; the sync twin puts after fetch (same rounds)."""
    plane = cd.DataPlane(spec(), capacity_per_rank=500, seed=4, schedule=schedule)
    model = Learner()
    if schedule == "overlap":
        plane.attach(model)
    got, stored, lags = [], [], []
    for it in range(6):
        if schedule == "overlap" or it == 0:
            plane.put(make_batch(_ids(rank, it, 5 + rank)))
        b = plane.fetch(7)
        assert_intact(b)
        got.append(b["id"].tolist())
        stored.append(plane.stored)
        if schedule == "sync" and it > 0:
            plane.put(make_batch(_ids(rank, it, 5 + rank)))
        lags.append(plane.last_fetch.lag_rounds if plane.last_fetch else None)
        _train_step(model, b)
    plane.close()
    return got, stored, lags


def test_overlap_returns_exactly_the_sync_batches_and_lags_at_most_one_round():
    over = run_ranks(_off_policy, 2, "overlap")
    sync = run_ranks(_off_policy, 2, "sync")
    for rank in range(2):
        assert over[rank][0] == sync[rank][0]
        assert over[rank][2] == [0, 1, 1, 1, 1, 1]
        # fetch k (k >= 1) saw every item put up to iteration k - 1 on every rank: never misses
        # experience put two iterations earlier
        per_iter = 5 + 6
        assert over[rank][1] == [per_iter] + [per_iter * k for k in range(1, 6)]


def _on_policy(rank, world, schedule):
    """max_lag=0: each iteration puts a rollout, then fetches 3 minibatches with more=True."""
    plane = cd.DataPlane(spec(), capacity_per_rank=500, seed=9, schedule=schedule, max_lag=0)
    model = Learner()
    plane.attach(model)
    got, prefetched = [], []
    total = 0
    for it in range(3):
        plane.put(make_batch(_ids(rank, it, 4)))
        total += 4 * world
        for mb in range(3):
            b = plane.fetch(6, more=mb < 2)
            assert len(plane) == total  # never misses experience put before it
            assert plane.last_fetch.lag_rounds == 0
            prefetched.append(plane.last_fetch.prefetched)
            got.append(b["id"].tolist())
            _train_step(model, b)
    if schedule == "overlap":
        plane.fetch(6, more=True)
        _train_step(model, b)
        with pytest.raises(cd.ConfigError, match="max_lag=0"):
            plane.put(make_batch(_ids(rank, 9, 4)))
    plane.close()
    return got, prefetched


def test_max_lag_zero_overlaps_only_between_minibatches():
    over = run_ranks(_on_policy, 2, "overlap")
    sync = run_ranks(_on_policy, 2, "sync")
    for rank in range(2):
        assert over[rank][0] == sync[rank][0]
        assert over[rank][1] == [False, True, True] * 3
        assert sync[rank][1] == [False] * 9


def _accounting(rank, world, out_dir):
    plane = cd.DataPlane(spec(), capacity_per_rank=5000, seed=1, trace=True)
    model = Learner(slow=0.05)
    plane.attach(model)
    timings = []
    for it in range(5):
        plane.put(make_batch(_ids(rank, it, 200)))
        b = plane.fetch(256)
        timings.append(plane.last_fetch)
        _train_step(model, b)
    path = plane.export_trace(f"{out_dir}/trace_{rank}.json")
    plane.close()
    return [(t.prefetched, t.exposed_ms, t.hidden_ms, sorted(t.phases)) for t in timings], path


def test_accounting_and_trace(tmp_path):
    import json

    res = run_ranks(_accounting, 2, str(tmp_path))
    for timings, path in res.values():
        first, rest = timings[0], timings[1:]
        assert not first[0] and first[2] == 0.0  # sync first round: nothing hidden
        for prefetched, _exposed, hidden, phases in rest:
            assert prefetched and hidden > 0  # ran during the 50 ms backward
            assert phases == ["deliver", "ingest", "sample", "weights"]
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        names = {(e["name"], e.get("tid")) for e in events}
        assert ("fetch (waiting)", 1) in names and ("ingest", 2) in names
        assert ("forward", 1) in names and ("backward start", 1) in names


def _backward_inside_staged(rank, world):
    plane = cd.DataPlane(spec(), capacity_per_rank=500, seed=2, schedule="overlap")
    model = Learner()
    plane.attach(model)
    prefetched, put, b = [], [], None
    for it in range(4):
        ids = _ids(rank, it, 6)
        with plane.staged(6) as rows:  # a learner step runs while the producer writes
            for k, v in make_batch(ids).items():
                rows[k].copy_(v)
            if b is not None:
                _train_step(model, b)  # backward inside the block: no launch under the views
        put.append(ids)
        b = plane.fetch(8)
        assert_intact(b)
        prefetched.append(plane.last_fetch.prefetched)
    _train_step(model, b)  # outside a block: launches the next fetch's round
    b = plane.fetch(8)
    prefetched.append(plane.last_fetch.prefetched)
    plane.wait()
    plane.close()
    return prefetched, torch.cat(put).tolist(), len(plane)


def test_backward_inside_a_staged_block_launches_nothing():
    res = run_ranks(_backward_inside_staged, 2)
    put = sorted(x for r in res.values() for x in r[1])
    for prefetched, _, size in res.values():
        assert prefetched == [False] * 4 + [True]
        assert size == len(put)


def _special_models(rank, world):
    # no parameter requires grad: no backward, every fetch runs its round itself
    frozen = Learner().requires_grad_(False)
    plane = cd.DataPlane(spec(), capacity_per_rank=100)
    plane.attach(frozen)
    assert len(frozen._forward_hooks) == 1 and len(frozen._forward_pre_hooks) == 1
    plane.put(make_batch(torch.arange(10) + 100 * rank))
    for _ in range(3):
        b = plane.fetch(4)
        frozen(b["obs"])
        assert not plane.last_fetch.prefetched
    plane.close()
    assert not frozen._forward_hooks and not frozen._forward_pre_hooks

    # gradient accumulation: two backward passes per fetch launch one round
    model = Learner()
    plane = cd.DataPlane(spec(), capacity_per_rank=100)
    plane.attach(torch.nn.parallel.DistributedDataParallel(model))
    plane.put(make_batch(torch.arange(10) + 100 * rank))
    rounds, prefetched = [], []
    for _ in range(4):
        b = plane.fetch(4)
        rounds.append(plane.last_fetch.round)
        prefetched.append(plane.last_fetch.prefetched)
        _train_step(model, b)
        _train_step(model, b)
    assert rounds == [0, 1, 2, 3] and prefetched == [False, True, True, True]
    # evaluation (no backward) between fetches: the round runs inside fetch
    with torch.no_grad():
        b = plane.fetch(4)  # the round launched by the last backward
        assert plane.last_fetch.prefetched
        model(b["obs"])
        b = plane.fetch(4)
    assert not plane.last_fetch.prefetched
    with pytest.raises(cd.ConfigError, match="attached already"):
        plane.attach(model)
    plane.detach()
    assert not model._forward_hooks
    plane.close()

    # a fixed sync schedule: no hook, unless a trace records the forward spans
    for trace in (False, True):
        plane = cd.DataPlane(spec(), capacity_per_rank=100, schedule="sync", trace=trace)
        plane.attach(model)
        assert len(model._forward_hooks) == len(model._forward_pre_hooks) == int(trace)
        with pytest.raises(cd.ConfigError, match="attached already"):
            plane.attach(model)  # attached all the same
        plane.put(make_batch(torch.arange(10) + 100 * rank))
        _train_step(model, plane.fetch(4))
        assert not plane.last_fetch.prefetched
        plane.detach()
        assert not model._forward_hooks and not model._forward_pre_hooks
        plane.attach(model)  # detached: may attach again
        plane.close()
        assert not model._forward_hooks
    return True


def test_hooks_removed_on_close_and_special_models():
    assert all(run_ranks(_special_models, 2).values())


def test_schedule_and_lag_arguments_are_checked():
    cd.init_distributed()
    with pytest.raises(cd.ConfigError, match="schedule.*'later'"):
        cd.DataPlane(spec(), capacity_per_rank=4, schedule="later")
    with pytest.raises(cd.ConfigError, match="max_lag.*-1"):
        cd.DataPlane(spec(), capacity_per_rank=4, max_lag=-1)


def _auto(rank, world):
    plane = cd.DataPlane(spec(), capacity_per_rank=500, seed=3, schedule="auto", auto_trial=6)
    model = Learner()
    plane.attach(model)
    modes = []
    for it in range(20):
        plane.put(make_batch(_ids(rank, it, 4)))
        b = plane.fetch(5)
        modes.append((plane.chosen_schedule, plane.last_fetch.prefetched))
        _train_step(model, b)
    trial = plane._p.control.trial
    medians = (trial.median("sync"), trial.median("overlap"))
    hooks = len(model._forward_hooks)
    with pytest.raises(cd.ConfigError, match="attached already"):
        plane.attach(model)  # attached, hooks or not
    plane.close()
    return modes, trial.choice, medians, hooks


def test_auto_schedule_tries_sync_then_overlap_and_keeps_the_faster():
    for modes, choice, (sync_ms, overlap_ms), hooks in run_ranks(_auto, 2).values():
        assert hooks == (choice == "overlap")  # settled on sync: the hooks came off
        assert [p for _, p in modes[:7]] == [False] * 7  # sync trial: no prefetch
        assert any(p for _, p in modes[7:13])  # overlap trial: rounds launched at backward
        assert choice == ("overlap" if overlap_ms < sync_ms else "sync")
        assert {m for m, _ in modes[14:]} == {choice}


def test_backward_trigger_hooks_come_off_and_back_while_attached():
    from conduit_dist.sched.hooks import BackwardTrigger

    model, fired = Learner(), []
    trigger = BackwardTrigger(model, lambda: fired.append(1), active=False)
    model(torch.ones(2, 3)).sum().backward()
    assert trigger.attached and not trigger.hooked and not fired
    trigger.activate()
    trigger.activate()  # once only
    assert len(model._forward_hooks) == 1
    model(torch.ones(2, 3)).sum().backward()
    assert fired == [1]
    trigger.deactivate()
    model(torch.ones(2, 3)).sum().backward()
    assert fired == [1] and trigger.attached and not model._forward_pre_hooks
    trigger.remove()
    assert not trigger.attached


def _restored(rank, world):
    hooked = []
    for choice, order in [(c, o) for c in ("sync", "overlap") for o in ("load", "attach")]:
        plane = cd.DataPlane(spec(), capacity_per_rank=100, schedule="auto", auto_trial=6)
        model, control = Learner(), plane._p.control
        state = {"overlap": choice == "overlap", "choice": choice}
        if order == "load":
            control.load_state_dict(state)
            plane.attach(model)
        else:
            plane.attach(model)
            hooked.append(("trial", control.trigger.hooked))  # the trial still to run
            control.load_state_dict(state)
        hooked.append((choice, control.trigger.hooked, len(model._forward_hooks)))
        plane.close()
    return hooked


def test_a_restored_auto_choice_puts_the_hooks_on_only_for_overlap():
    """Resumed auto runs: the trial's choice restored before or after attach."""
    for hooked in run_ranks(_restored, 2).values():
        assert hooked == [
            ("sync", False, 0),
            ("trial", True),
            ("sync", False, 0),
            ("overlap", True, 1),
            ("trial", True),
            ("overlap", True, 1),
        ]
