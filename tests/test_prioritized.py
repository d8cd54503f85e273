"""Prioritized replay over real gloo ranks: exact draws, weights, routed and stale updates."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
from dist_utils import needs_native, run_ranks

import conduit_dist as cd
from conduit_dist.errors import ConfigError, SpecError

SPEC = {"id": ((), torch.int64), "obs": ((3,), torch.float32)}
ALPHA, BETA, EPS = 0.7, 0.6, 0.01


def _prio(ids: torch.Tensor) -> torch.Tensor:
    return 1.0 + (ids % 5).double() * 1.5  # priorities 1 .. 7


def _mass(ids: torch.Tensor) -> torch.Tensor:
    return (_prio(ids) + EPS) ** ALPHA


def _items(rank: int, n: int) -> dict[str, torch.Tensor]:
    ids = torch.arange(n) + 1000 * rank
    return {"id": ids, "obs": ids.float()[:, None].expand(n, 3).contiguous()}


def _uneven(rank: int, world: int, rounds: int, batch: int) -> dict[str, object]:
    sampler = cd.Prioritized(ALPHA, BETA, EPS, initial_priority=50.0)  # above every update
    plane = cd.DataPlane(
        cd.ExperienceSpec(SPEC), 64, seed=3, sampler=sampler, placement="local", schedule="sync"
    )
    plane.put(_items(rank, 5 + 9 * rank))  # 5, 14, 23 items: uneven shards
    for _ in range(6):  # every item is drawn and given its priority
        b = plane.fetch(batch, oversample=True)
        plane.update_priorities(b["_index"], _prio(b["id"]))
    counts: dict[int, int] = {}
    weights_ok = True
    all_ids = torch.cat([_items(r, 5 + 9 * r)["id"] for r in range(world)])
    m_min = float(_mass(all_ids).min())
    for _ in range(rounds):
        b = plane.fetch(batch, oversample=True)
        plane.update_priorities(b["_index"], _prio(b["id"]))
        want = ((_mass(b["id"]) / m_min) ** -BETA).float()
        weights_ok &= torch.allclose(b["_weight"], want, rtol=1e-5)
        for i in b["id"].tolist():
            counts[i] = counts.get(i, 0) + 1
    stats = plane.store_stats()
    fused = plane._p.engine.from_candidates
    plane.close()
    return {"counts": counts, "weights_ok": weights_ok, "stats": stats, "fused": fused}


def test_prioritized_is_exact_over_uneven_shards():
    """Draws follow ``m_i / sum m`` over 3 uneven shards once priorities came back through
    update_priorities (routed to the owner in the rounds), and ``_weight`` is the formula with
    the global minimum."""
    rounds, batch = 60, 64
    res = run_ranks(_uneven, 3, rounds, batch, timeout_s=240)
    ids = torch.cat([_items(r, 5 + 9 * r)["id"] for r in range(3)])
    p = _mass(ids) / _mass(ids).sum()
    for rank, got in res.items():
        assert got["weights_ok"], rank
        assert got["stats"]["priority_updates_applied"] > 0
        assert got["fused"] > rounds // 2, got["fused"]  # delivered from the one exchange
        n = rounds * batch
        chi2 = sum(
            (got["counts"].get(int(i), 0) - n * float(q)) ** 2 / (n * float(q))
            for i, q in zip(ids, p)
        )
        df = ids.numel() - 1
        assert chi2 < df + 5 * math.sqrt(2 * df), (rank, chi2, df)
        assert set(got["counts"]) <= set(ids.tolist())


def _stale(rank: int, world: int) -> dict[str, int]:
    plane = cd.DataPlane(
        cd.ExperienceSpec(SPEC), 8, seed=1, sampler=cd.Prioritized(1.0, 0.5, 0.0),
        placement="local", schedule="sync",
    )  # fmt: skip
    plane.put(_items(rank, 8))
    old = plane.fetch(16)
    plane.put(_items(rank + 10, 8))  # overwrites every slot of this shard
    plane.fetch(16)  # the new items arrive; `old`'s slots now hold other generations
    plane.update_priorities(old["_index"], torch.full((16,), 100.0))
    for _ in range(3):
        b = plane.fetch(64, oversample=True)
    stats = plane.store_stats()
    weights = b["_weight"]
    plane.close()
    return {**{k: v for k, v in stats.items() if k.startswith("priority")}, "w": weights}


def test_update_for_an_overwritten_slot_is_dropped():
    """An update whose item was overwritten since it was sampled is dropped and counted (never
    applied to the new item: the new items keep equal priorities, so every weight stays 1)."""
    res = run_ranks(_stale, 2, timeout_s=120)
    dropped = sum(r["priority_updates_dropped"] for r in res.values())
    applied = sum(r["priority_updates_applied"] for r in res.values())
    assert (dropped, applied) == (32, 0)
    for r in res.values():
        assert torch.equal(r["w"], torch.ones_like(r["w"]))


def test_priority_follows_items_across_tiers():
    """One rank, two tiers: items demoted to the second tier keep their priorities."""
    storage = cd.Tiers([("host", 6), ("host", 18)], gbps={"host": (1.0, 1.0)})
    plane = cd.DataPlane(
        cd.ExperienceSpec(SPEC), 24, sampler=cd.Prioritized(1.0, 0.0, 0.0), storage=storage
    )
    plane.put(_items(0, 6))
    for _ in range(4):
        b = plane.fetch(32, oversample=True)
        plane.update_priorities(b["_index"], _prio(b["id"]))
    for k in range(3):  # 12 newer items push the first 6 into the second tier
        plane.put(_items(1 + k, 4))
        b = plane.fetch(32, oversample=True)
        plane.update_priorities(b["_index"], _prio(b["id"]))
    tiers = plane.store_stats()["tiers"]
    assert tiers[1]["items"] >= 6
    counts = torch.zeros(6)
    n = 0
    for _ in range(40):
        b = plane.fetch(256, oversample=True)
        plane.update_priorities(b["_index"], _prio(b["id"]))
        first = b["id"] < 6
        counts += torch.bincount(b["id"][first], minlength=6)[:6]
        n += 256
    ids = torch.cat([_items(0, 6)["id"], *[_items(1 + k, 4)["id"] for k in range(3)]])
    p = (_prio(ids) / _prio(ids).sum())[:6]
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 6 + 5 * math.sqrt(12), chi2
    plane.close()


def test_prioritized_rejects_bad_input():
    """Bad updates are clear errors that queue nothing; reserved names and unsupported set-ups
    are refused."""
    plane = cd.DataPlane(cd.ExperienceSpec(SPEC), 16, sampler=cd.Prioritized())
    plane.put(_items(0, 4))
    b = plane.fetch(4)
    with pytest.raises(ConfigError, match="finite values >= 0"):
        plane.update_priorities(b["_index"], torch.tensor([1.0, float("nan"), 1.0, 1.0]))
    with pytest.raises(ConfigError, match="finite values >= 0"):
        plane.update_priorities(b["_index"], torch.tensor([1.0, -1.0, 1.0, 1.0]))
    with pytest.raises(ConfigError, match=r"expected shape \[4\]"):
        plane.update_priorities(b["_index"], torch.ones(3))
    with pytest.raises(ConfigError, match="int64"):
        plane.update_priorities(b["_index"].int(), torch.ones(4))
    with pytest.raises(ConfigError, match="ranks 0..0"):
        plane.update_priorities(b["_index"] + (5 << 48), torch.ones(4))
    assert plane.sampler.pending() == 0
    plane.close()
    with pytest.raises(SpecError, match="reserved"):
        cd.ExperienceSpec({"_index": ((), torch.int64)})
    uniform = cd.DataPlane(cd.ExperienceSpec(SPEC), 16)
    with pytest.raises(ConfigError, match="takes no priority updates"):
        uniform.update_priorities(torch.zeros(1, dtype=torch.int64), torch.ones(1))
    uniform.close()
    with pytest.raises(ConfigError, match="beta"):
        cd.Prioritized(beta=2.0)


def test_prioritized_on_cuda_without_a_gpu_names_the_missing_cuda():
    """CUDA delivery is not refused for any sampler (rows composed on the host land on the
    GPU); on a machine without CUDA the error says so, before anything is built."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="CUDA is not available here"):
        cd.DataPlane(cd.ExperienceSpec(SPEC), 16, sampler=cd.Prioritized(), device="cuda")


def test_state_round_trip_keeps_priorities_windows_and_queued_updates(tmp_path):
    """A checkpoint (loaded with weights_only=True) restores the leaves, the stream links and
    the updates not applied yet: the restored plane draws exactly what the original draws."""
    seq = cd.Windows(n_step=2, gamma=0.5, done="done", reward="reward", stream="env")
    fields = {
        **SPEC,
        "env": ((), torch.int64),
        "reward": ((), torch.float32),
        "done": ((), torch.bool),
    }
    spec = cd.ExperienceSpec(fields)

    def plane():
        return cd.DataPlane(spec, 32, seed=4, sampler=cd.Prioritized(1.0, 0.5, 0.01, sequence=seq))

    def items(t):
        return {
            **_items(0, 2), "id": torch.tensor([t, 100 + t]), "env": torch.arange(2),
            "reward": torch.ones(2), "done": torch.tensor([t % 5 == 4, False]),
        }  # fmt: skip

    a = plane()
    a.put(items(0))
    a.flush()  # an n-step window needs the next item
    for t in range(1, 20):
        a.put(items(t))
        b = a.fetch(8, oversample=True)
        a.update_priorities(b["_index"], (b["id"] % 7).double())
    path = tmp_path / "plane.pt"
    torch.save(a.state_dict(), path)
    c = plane()
    c.load_state_dict(torch.load(path, weights_only=True))
    for _ in range(3):
        x, y = a.fetch(64, oversample=True), c.fetch(64, oversample=True)
        for k in x:
            assert torch.equal(x[k], y[k]), k
    assert a.store_stats()["priority_updates_applied"] > 0
    a.close()
    c.close()


def _zero_mass(rank: int, world: int) -> list[int]:
    plane = cd.DataPlane(
        cd.ExperienceSpec(SPEC), 16, seed=1, sampler=cd.Prioritized(1.0, 0.5, 0.0),
        placement="local", schedule="sync",
    )  # fmt: skip
    plane.put(_items(rank, 4))
    drawn = []
    for _ in range(6):
        b = plane.fetch(8)
        owner = b["_index"] >> 48
        drawn.append(int((owner == 0).sum()))
        plane.update_priorities(b["_index"], torch.where(owner == 0, 0.0, 1.0).double())
    plane.close()
    return drawn


def test_a_shard_whose_mass_falls_to_zero_is_drawn_from_no_more():
    """Every priority on rank 0's shard set to 0 (eps=0): its mass is 0, the rounds go on (it
    owed candidates from the round before: found by review, it used to fail drawing them), and
    no item of it is delivered again."""
    res = run_ranks(_zero_mass, 2, timeout_s=120)
    for drawn in res.values():
        assert drawn[-3:] == [0, 0, 0], drawn


def test_prioritized_refuses_overflowing_masses():
    plane = cd.DataPlane(cd.ExperienceSpec(SPEC), 8, sampler=cd.Prioritized(alpha=2.0))
    plane.put(_items(0, 2))
    b = plane.fetch(2)
    with pytest.raises(ConfigError, match="must be finite"):
        plane.update_priorities(b["_index"], torch.tensor([1e200, 1.0], dtype=torch.float64))
    plane.close()
    with pytest.raises(ConfigError, match="pass sequence=None"):
        cd.Prioritized(sequence=cd.Windows(length=1))


def test_update_queue_keeps_order_across_partial_sends_growth_and_states():
    """Pairs wait in reused buffers: sent oldest first within each peer's budget (the rest
    moved to the front), grown past their first size, received and own pairs taken together,
    and a state round trip keeps what waits."""
    from conduit_dist.sampling.updates import GEN_MASK, RANK_SHIFT, UpdateQueue

    q = UpdateQueue(rank=0, world=3)
    owners = torch.tensor([1, 0, 2, 1] * 50)  # 200 updates: past the buffers' first 64 rows
    index = (owners << RANK_SHIFT) | torch.arange(200)
    prio = torch.arange(200, dtype=torch.float32) / 8  # float32: converted by the queue
    q.queue(index[:40], prio[:40])  # then grown while holding these
    q.queue(index[40:], prio[40:])
    assert q.pending() == 200
    with pytest.raises(ConfigError, match="got -1.0 at position 1"):
        q.queue(index[:2], torch.tensor([1.0, -1.0]))  # nothing queued
    assert q.pending() == 200

    def gens(rows):
        return (rows[:, 0] & GEN_MASK).tolist()

    want1 = [i for i in range(200) if owners[i] == 1]  # 100 for peer 1, in put order
    sent = q.outgoing({1: 30, 2: 0})
    assert list(sent) == [1] and gens(sent[1]) == want1[:30]
    assert sent[1][:, 1].view(torch.float64).tolist() == [i / 8 for i in want1[:30]]
    sent = q.outgoing({1: 500})
    assert gens(sent[1]) == want1[30:]  # the rest, moved to the front, in order
    assert q.outgoing({1: 5}) == {}
    q.incoming(torch.tensor([[7, 0], [8, 0]]))
    state = q.state_dict()
    own = q.take_own()
    assert gens(own) == [7, 8] + [i for i in range(200) if owners[i] == 0]
    assert q.take_own() is None and q.pending() == 50  # peer 2's wait
    restored = UpdateQueue(rank=0, world=3)
    restored.load_state_dict(state)
    assert gens(restored.take_own()) == gens(own)
    assert gens(restored.outgoing({2: 100})[2]) == [i for i in range(200) if owners[i] == 2]
    with pytest.raises(ConfigError, match="expected owner ranks 0..1"):
        UpdateQueue(rank=0, world=2).load_state_dict(state)  # a state of three ranks


def test_sum_tree_fill_matches_set_natively_and_without_the_extension(monkeypatch):
    """``fill`` (one native call, or ``set`` through a reused buffer) gives ``set``'s tree, and
    a negative or infinite value is refused before any leaf changes."""
    from conduit_dist.sampling import sumtree

    needs_native("tree_fill", "tree_set")

    def build(use_fill: bool) -> sumtree.SumTree:
        tree = sumtree.SumTree(1000)
        tree.set(torch.arange(1000), torch.rand(1000, generator=torch.Generator().manual_seed(0)))
        idx = torch.tensor([3, 999, 3, 512, 0])
        for value in (0.0, 2.5):
            if use_fill:
                tree.fill(idx, value)
            else:
                tree.set(idx, torch.full((5,), value, dtype=torch.float64))
        return tree

    want = build(False)
    for native in (True, False):
        if not native:
            monkeypatch.setattr(sumtree, "_native", None)
        got = build(True)
        assert torch.equal(got.sum, want.sum) and torch.equal(got.min, want.min), native
    monkeypatch.undo()
    before = want.sum.clone()
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="expected a finite value >= 0"):
            want.fill(torch.tensor([1, 2]), bad)
    assert torch.equal(want.sum, before)
    for copied in (copy.deepcopy(want), pickle.loads(pickle.dumps(want))):  # its own arrays
        copied.fill(torch.tensor([1]), 5.0)
        assert copied.leaves()[1] == 5.0 and copied.total == float(copied.leaves().sum())
    assert torch.equal(want.sum, before)  # the original untouched
