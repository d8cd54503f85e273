"""ShardedReplayBuffer: TorchRL's replay-buffer calls over the plane, on 1 and 2 real gloo ranks,
and the TorchRL DQN example run for a few hundred steps."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from dist_utils import ROOT, child_env, run_ranks

pytest.importorskip("torchrl")
from tensordict import TensorDict

import conduit_dist as cd
from conduit_dist.errors import ConfigError, SpecError
from conduit_dist.integrations.torchrl import ShardedReplayBuffer


def _batch(ids: torch.Tensor) -> TensorDict:
    """A TorchRL-shaped transition batch whose every leaf is a function of the item's id."""
    n = ids.shape[0]
    f = ids.to(torch.float32)
    return TensorDict(
        {
            "observation": f[:, None].repeat(1, 4),
            "action": torch.stack([ids, -ids], 1),
            "next": {
                "observation": f[:, None].repeat(1, 4) + 0.5,
                "reward": torch.ones(n, 1),
                "done": (ids % 2 == 0)[:, None],
                "pixels": (ids % 251).to(torch.uint8)[:, None, None].repeat(1, 2, 3),
            },
            ("collector", "traj_ids"): ids,
        },
        batch_size=[n],
    )


def _check_rows(td: TensorDict, n: int) -> list[int]:
    """Every leaf of every sampled row matches its id exactly (nested keys round-trip);
    returns the ids."""
    assert td.batch_size == torch.Size([n])
    ids = td["collector", "traj_ids"]
    assert ids.dtype == torch.int64
    expect = _batch(ids)
    for key in expect.keys(include_nested=True, leaves_only=True):
        got, want = td[key], expect[key]
        assert got.dtype == want.dtype and got.shape == want.shape, key
        assert torch.equal(got, want), key
    assert td["_version"].dtype == torch.int64
    return ids.tolist()


def test_round_trip_on_one_rank():
    with ShardedReplayBuffer(100, batch_size=16, seed=3) as rb:
        assert len(rb) == 0
        rb.extend(_batch(torch.arange(40)))
        assert len(rb) == 40  # extend ran a round: len counts the items at once
        td = rb.sample()
        assert set(_check_rows(td, 16)) <= set(range(40))
        assert "index" not in td  # the uniform sampler delivers no addresses
        assert td.device == torch.device("cpu")
        rb.extend(_batch(torch.arange(40, 100)))
        assert len(rb) == 100
        assert len(_check_rows(rb.sample(64), 64)) == 64
        assert "len=100" in repr(rb) and "next.observation" in repr(rb)
        with pytest.raises(ConfigError, match="takes no priorities"):
            rb.update_tensordict_priority(td)


def test_bad_batches_name_the_key_and_store_nothing():
    rb = ShardedReplayBuffer(100, batch_size=8)
    bad = _batch(torch.arange(4))
    bad["next", "stamp"] = torch.zeros(4, dtype=torch.complex64)
    with pytest.raises(SpecError, match=r"\('next', 'stamp'\).*complex64"):
        rb.extend(bad)  # the first extend: no plane is built
    assert rb.plane is None and len(rb) == 0
    rb.extend(_batch(torch.arange(10)))
    missing = _batch(torch.arange(4)).exclude(("next", "reward"))
    with pytest.raises(SpecError, match=r"missing \[\('next', 'reward'\)\]"):
        rb.extend(missing)
    wrong = _batch(torch.arange(4))
    wrong["action"] = wrong["action"].to(torch.int32)
    with pytest.raises(SpecError, match="key 'action': expected torch.int64 .* got torch.int32"):
        rb.extend(wrong)
    reserved = _batch(torch.arange(4))
    reserved["index"] = torch.arange(4)
    with pytest.raises(SpecError, match="key 'index' is reserved"):
        rb.extend(reserved)
    assert len(rb) == 10
    rb.extend(_batch(torch.arange(10, 12)))  # still usable
    assert len(rb) == 12
    rb.close()


def test_prioritized_updates_change_what_is_sampled():
    rb = ShardedReplayBuffer(200, batch_size=64, sampler=cd.Prioritized(alpha=1.0, beta=0.5))
    rb.extend(_batch(torch.arange(100)))
    td, info = rb.sample(return_info=True)
    assert td["index"].dtype == torch.int64 and td["priority_weight"].dtype == torch.float32
    assert torch.equal(td["_weight"], td["priority_weight"]) and info.keys() == {
        "index",
        "priority_weight",
    }
    before = sum(i < 10 for i in _check_rows(td, 64))
    # every item: high priority for ids < 10, ~0 for the others (one update per sampled row)
    for _ in range(6):
        td = rb.sample()
        ids = td["collector", "traj_ids"]
        td["td_error"] = torch.where(ids < 10, 1e4, 0.0)[:, None]  # [B, 1], as DQNLoss writes
        rb.update_tensordict_priority(td)
    hot = [sum(i < 10 for i in _check_rows(rb.sample(), 64)) for _ in range(3)]
    assert before < 25 and min(hot) >= 60, (before, hot)
    rb.close()


def test_state_dict_loads_with_weights_only(tmp_path):
    sampler = cd.Prioritized(alpha=0.6, beta=0.4)
    rb = ShardedReplayBuffer(64, batch_size=16, sampler=sampler, seed=5)
    rb.extend(_batch(torch.arange(50)))
    td = rb.sample()
    rb.update_priority(td["index"], torch.rand(16))
    rb.extend(_batch(torch.arange(50, 80)))  # the ring wraps: 64 kept
    torch.save(rb.state_dict(), tmp_path / "rb.pt")
    want = rb.sample(32)
    rb.close()
    fresh = ShardedReplayBuffer(64, batch_size=16, sampler=cd.Prioritized(0.6, 0.4), seed=5)
    fresh.load_state_dict(torch.load(tmp_path / "rb.pt", weights_only=True))
    assert len(fresh) == 64
    got = fresh.sample(32)  # the same round of the same seed: the same draw
    assert _check_rows(got, 32) == _check_rows(want, 32)
    assert torch.equal(got["priority_weight"], want["priority_weight"])
    other = ShardedReplayBuffer(32, batch_size=16)
    with pytest.raises(ConfigError, match="capacity_per_rank: saved 64, buffer has 32"):
        other.load_state_dict(torch.load(tmp_path / "rb.pt", weights_only=True))
    fresh.close()


def test_torchrl_only_arguments_and_methods_say_what_to_do():
    from torchrl.data import LazyTensorStorage, RandomSampler

    with pytest.raises(NotImplementedError, match="the plane is the storage"):
        ShardedReplayBuffer(10, storage=LazyTensorStorage(10))
    with pytest.raises(NotImplementedError, match="torchrl's RandomSampler.*sampler='uniform'"):
        ShardedReplayBuffer(10, sampler=RandomSampler())
    with pytest.raises(ConfigError, match="unknown argument 'capacity'"):
        ShardedReplayBuffer(10, capacity=3)
    rb = ShardedReplayBuffer(10)
    with pytest.raises(NotImplementedError, match="empty"):
        rb.empty()
    with pytest.raises(NotImplementedError, match="no global position"):
        _ = rb[0]
    with pytest.raises(ConfigError, match="extend the buffer first"):
        rb.sample(4)


def _two_ranks(rank: int, world: int) -> dict:
    out: dict = {}
    rb = ShardedReplayBuffer(64, batch_size=32, sampler=cd.Prioritized(alpha=1.0, beta=0.5))
    first = _batch(torch.arange(4))
    if rank == 1:
        first["action"] = first["action"].float()
    try:
        rb.extend(first)
    except SpecError as e:
        out["first"] = str(e)
    ids = torch.arange(30) + 1000 * rank  # rank 0: 0..29, rank 1: 1000..1029
    rb.extend(_batch(ids))
    out["len"] = len(rb)  # both ranks' items, right after extend
    bad = _batch(ids[:4]).exclude("action") if rank == 0 else _batch(ids[:4])
    try:
        rb.extend(bad)  # rank 1's batch is fine; rank 0's is refused: only rank 1's stored
    except SpecError as e:
        out["bad"] = str(e)
    out["len_after_bad"] = len(rb)
    seen = []
    for _ in range(6):
        td = rb.sample()
        got = td["collector", "traj_ids"]
        seen += _check_rows(td, 32)
        td["td_error"] = torch.where(got < 10, 1e4, 0.0)
        rb.update_tensordict_priority(td)
    out["seen_ranks"] = sorted({i // 1000 for i in seen})
    out["hot"] = sum(i < 10 for i in _check_rows(rb.sample(), 32))
    rb.close()
    return out


def test_two_ranks_share_one_store():
    res = run_ranks(_two_ranks, 2, timeout_s=120)
    for rank in (0, 1):
        r = res[rank]
        assert "layout differs between ranks" in r["first"] and "torch.float32" in r["first"]
        assert r["len"] == 60 and r["len_after_bad"] == 64
        assert r["seen_ranks"] == [0, 1]  # every learner samples the global store
        assert r["hot"] >= 28, r
    assert "missing ['action']" in res[0]["bad"] and "bad" not in res[1]


def _run_example(*args: str, torchrun: bool = False) -> dict:
    script = str(ROOT / "examples" / "torchrl_dqn.py")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd = [*(launch if torchrun else [sys.executable]), script, *args]
    res = subprocess.run(
        cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=240
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("sampler", "torchrun"), [("prioritized", False), ("uniform", True)], ids=["1", "2"]
)
def test_the_torchrl_example_runs(sampler, torchrun):
    out = _run_example(
        "--total-frames", "640", "--init-random-frames", "320", "--log-every", "320",
        "--sampler", sampler, torchrun=torchrun,
    )  # fmt: skip
    assert out["env_steps"] == 640 and out["world"] == (2 if torchrun else 1)
    assert out["sampler"] == sampler and isinstance(out["reached"], bool)
    assert out["episodes"] > 0 and out["last50"] > 0 and out["wall_s"] > 0
