"""The token plane's next round launched behind the backward (``fetch_start``, ``attach``): the
same sequences and whole groups as rounds run inside ``fetch``, on 2 gloo ranks; the time it ran
before the learner asked counted as hidden; and what a close leaves undelivered, counted."""

from __future__ import annotations

import time

import pytest
import torch
from dist_utils import run_ranks
from test_tokens import check_whole, group_batch, make_spec

import conduit_dist as cd
from conduit_dist.errors import ConfigError
from conduit_dist.rounds.devices import REHEARSAL_ENV

STEPS, PER_STEP, BUDGET = 6, 6, 300


def _groups(step: int, rank: int, world: int) -> list[int]:
    """This rank's groups of a step's global batch."""
    return [g for g in range(step * PER_STEP, (step + 1) * PER_STEP) if g % world == rank]


def _run(rank: int, world: int, how: str) -> dict[str, object]:
    """``STEPS`` global batches: ``sync`` (puts, then a fetch running its rounds), ``start``
    (the next batch put and its round launched by fetch_start after each take), ``late`` (the
    round launched first, the batch put while it runs: the put waits for it), ``stream`` (as
    ``start``, for ``stream`` takes), ``attach`` (launched by the first backward of a module
    after the take)."""
    net = torch.nn.Linear(4, 1)
    out: dict[str, object] = {"digests": [], "timing": []}
    with cd.TokenPlane(make_spec(), 64, 16_384) as tp:
        if how == "attach":
            tp.attach(net)
        tp.put(*group_batch(_groups(0, rank, world)))
        for step in range(STEPS):
            if how == "stream":
                mbs = list(tp.stream(PER_STEP, BUDGET))
            else:
                mbs = tp.fetch(PER_STEP, BUDGET)
            seen = check_whole(mbs)
            out["digests"].append(sorted((g, sorted(d)) for g, d in seen.items()))
            out["timing"].append(tp.last_take)
            last = step + 1 == STEPS
            if how == "late" and not last:
                tp.fetch_start(PER_STEP, BUDGET, next_version=False)
            if not last:
                tp.put(*group_batch(_groups(step + 1, rank, world)))
            if how in ("start", "stream") and not last:
                tp.fetch_start(PER_STEP, BUDGET, stream=how == "stream", next_version=False)
            for _ in range(len(mbs)):  # one backward per micro-batch, as a learner runs
                net(torch.randn(8, 4)).sum().backward()
                time.sleep(0.03)  # the backward's off-CPU time: the launched round runs
        out["stats"] = tp.stats()
    return out


@pytest.fixture(scope="module")
def synced():
    """The rounds run inside ``fetch``: what every launched variant must deliver."""
    return run_ranks(_run, 2, "sync", timeout_s=180)


@pytest.mark.parametrize("how", ["start", "late", "stream", "attach"])
def test_rounds_launched_ahead_deliver_what_rounds_in_fetch_deliver(how, synced):
    ahead = run_ranks(_run, 2, how, timeout_s=180)
    if how == "stream":  # pieces as groups complete: which learner takes a group may differ
        for step in range(STEPS):
            got = sorted(d for r in (0, 1) for d in ahead[r]["digests"][step])
            assert got == sorted(d for r in (0, 1) for d in synced[r]["digests"][step]), step
    for rank in (0, 1):
        if how != "stream":
            assert ahead[rank]["digests"] == synced[rank]["digests"], rank  # byte for byte
        timing = ahead[rank]["timing"]
        assert not timing[0].launched and all(t.launched for t in timing[1:]), timing
        if how != "late":  # launched over the whole batch 30 ms before the take: ran first
            assert all(t.hidden_ms > 0 for t in timing[1:]), timing
        assert not any(t.launched for t in synced[rank]["timing"])


def _misuse(rank: int, world: int, root: str) -> dict[str, str]:
    errors = {}
    with cd.TokenPlane(make_spec(), 64, 16_384) as tp:
        tp.put(*group_batch(_groups(0, rank, world)))
        tp.fetch_start(PER_STEP, BUDGET)
        for what, call in (
            ("twice", lambda: tp.fetch_start(PER_STEP, BUDGET)),
            ("other", lambda: tp.fetch(PER_STEP + 2, BUDGET)),
            ("flush", tp.flush),
            ("state_dict", tp.state_dict),
            ("checkpoint", lambda: tp.checkpoint(root)),
            ("restore", lambda: tp.restore(root)),
        ):
            try:
                call()
            except ConfigError as exc:
                errors[what] = str(exc)
        mbs = tp.fetch(PER_STEP, BUDGET)  # the launched round still serves its take
        errors["taken"] = str(len(check_whole(mbs)))
        tp.put(*group_batch(_groups(1, rank, world)))
        tp.fetch_start(PER_STEP, BUDGET)  # never taken: counted at close
        tp.close()
        s = tp.stats()
        errors["close"] = f"{s['launched_at_close_groups']} {s['left_at_close_groups']}"
    return errors


def test_a_launched_round_is_taken_only_by_its_fetch_and_counted_if_never_taken(tmp_path):
    res = run_ranks(_misuse, 2, str(tmp_path), timeout_s=120)
    assert sum(int(e["taken"]) for e in res.values()) == PER_STEP  # the whole batch, once
    for e in res.values():
        assert "launched already" in e["twice"]
        assert (
            "launched ahead for (num_groups, token_budget, stream) = (6, 300, False)"
            in (e["other"])
        )
        assert "call fetch/stream to take them" in e["flush"]
        assert "take it (fetch/stream) first" in e["state_dict"]
        assert "checkpoint after that fetch/stream" in e["checkpoint"]
        assert "restore: a round was launched ahead" in e["restore"]
        # the never-taken round delivered the second batch (3 of its groups per learner)
        launched, left = (int(x) for x in e["close"].split())
        assert launched == PER_STEP and left == 0, e["close"]


def test_a_round_launched_for_the_next_version_selects_for_it():
    """Launched with ``next_version`` (the default), a round evicts what will be older than
    ``max_policy_age`` once the learner has published the version it is used at; launched for
    the version it has, it delivers those groups (and the learner uses them a version late)."""
    for next_version, want in ((True, [2, 3]), (False, [0, 1])):
        with cd.TokenPlane(make_spec(), 64, 16_384, max_policy_age=1) as tp:
            tp.put(*group_batch([0, 1]), version=0)
            tp.publish_weights()  # version 1
            tp.put(*group_batch([2, 3]), version=1)
            tp.fetch_start(2, BUDGET, next_version=next_version)
            tp.publish_weights()  # version 2: groups of version 0 are two behind
            assert sorted(check_whole(tp.fetch(2, BUDGET))) == want
            assert tp.stats()["stale_evicted"] == (2 if next_version else 0)


def test_reserve_refuses_to_wait_past_a_launched_round():
    """Waiting for room runs rounds; with a round launched for the next take, a ``reserve``
    within ``allowance()`` is granted and one beyond it is refused, naming the allowance."""
    with cd.TokenPlane(make_spec(), 64, 16_384, max_policy_age=0, groups_per_batch=2) as tp:
        assert tp.reserve([10, 11]) == 0
        tp.fetch_start(2, BUDGET, next_version=False)
        assert tp.allowance() == 0
        with pytest.raises(ConfigError, match=r"reserve at most allowance\(\)=0 groups"):
            tp.reserve([12])
        tp.put(*group_batch([10, 11]))
        assert sorted(check_whole(tp.fetch(2, BUDGET))) == [10, 11]


def _left(rank: int, world: int) -> dict[str, int]:
    with cd.TokenPlane(make_spec(), 64, 16_384) as tp:
        tp.put(*group_batch(_groups(0, rank, world)))
        tp.put(*group_batch(_groups(1, rank, world)))  # a batch more than is taken
        tp.fetch(PER_STEP, BUDGET)
    return tp.stats()


def test_groups_left_at_close_are_counted():
    for rank, s in run_ranks(_left, 2, timeout_s=120).items():
        assert s["left_at_close_groups"] == len(_groups(1, rank, 2)), s
        assert s["left_at_close_sequences"] == 4 * len(_groups(1, rank, 2)), s


def test_the_device_path_delivers_the_same_sequences(monkeypatch):
    """The device path's logic on CPU planes (``CONDUIT_DEVICE_ROWS_REHEARSAL=1``): every round
    on the round thread, launched rounds gated until their exchange is enqueued, the sections'
    lengths sent on the host beside them and the micro-batches cut without reading the
    received bytes: the same sequences, whole, as the host path."""
    monkeypatch.delenv(REHEARSAL_ENV, raising=False)
    host = run_ranks(_run, 2, "sync", timeout_s=180)
    monkeypatch.setenv(REHEARSAL_ENV, "1")
    device = run_ranks(_run, 2, "attach", timeout_s=180)
    for rank in (0, 1):
        assert device[rank]["digests"] == host[rank]["digests"], rank


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_a_cuda_token_plane_is_refused_at_once_saying_what_to_install():
    with pytest.raises(ConfigError, match=r"CUDA is not available here .* install a CUDA build"):
        cd.TokenPlane(make_spec(), 64, 16_384, device="cuda")
