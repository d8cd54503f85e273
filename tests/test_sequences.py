"""Slices and n-step windows on real gloo ranks: never across an episode end, the ring's wrap, a
tier boundary or a shard; n-step values against a single-process reference of the same items."""

from __future__ import annotations

import math
import random

import pytest
import torch
from dist_utils import needs_native, run_ranks

import conduit_dist as cd
from conduit_dist.errors import ConfigError

FIELDS = {
    "id": ((), torch.int64),
    "env": ((), torch.int64),
    "reward": ((), torch.float32),
    "done": ((), torch.bool),
    "truncated": ((), torch.bool),
}
ENVS, STEPS, GAMMA = 2, 90, 0.9


def _ends(rank: int, env: int, t: int) -> tuple[bool, bool]:
    """(done, truncated) of step t of a stream: episodes of uneven lengths (~9 steps)."""
    u = random.Random(rank * 1_000_003 + env * 7919 + t).random()
    return u < 0.07, 0.07 <= u < 0.11


def _item(rank: int, env: int, t: int) -> int:
    return rank * 1_000_000 + env * 10_000 + t


def _step(rank: int, t: int) -> dict[str, torch.Tensor]:
    ends = [_ends(rank, e, t) for e in range(ENVS)]
    ids = torch.tensor([_item(rank, e, t) for e in range(ENVS)])
    return {
        "id": ids,
        "env": torch.arange(ENVS),
        "reward": (ids % 1000).float() / 10,
        "done": torch.tensor([d for d, _ in ends]),
        "truncated": torch.tensor([tr for _, tr in ends]),
    }


def _decode(i: int) -> tuple[int, int, int]:
    return i // 1_000_000, (i // 10_000) % 100, i % 10_000


def _reference(i: int, n: int) -> tuple[int, float, float]:
    """(last item, return, discount) of an n-step window from item i, from the generator."""
    rank, env, t = _decode(i)
    ret, m, last = 0.0, 0, i
    for k in range(n):
        j = _item(rank, env, t + k)
        ret += GAMMA**k * (j % 1000) / 10
        m, last = k + 1, j
        done, trunc = _ends(rank, env, t + k)
        if done or trunc:
            return last, ret, 0.0 if done else GAMMA**m
    return last, ret, GAMMA**m


def _plane(seq: cd.Windows, capacity: int, storage=None) -> cd.DataPlane:
    return cd.DataPlane(
        cd.ExperienceSpec(FIELDS), capacity, seed=5, storage=storage, placement="local",
        schedule="sync", sampler=cd.Prioritized(alpha=0.0, beta=0.0, eps=0.0, sequence=seq),
    )  # fmt: skip


def _slices(rank: int, world: int) -> list[str]:
    seq = cd.Windows(length=4, burn_in=1, stream="env", truncated="truncated")
    storage = cd.Tiers([("host", 30), ("host", 40)], gbps={"host": (1.0, 1.0)})
    plane = _plane(seq, 70, storage)  # 180 items per shard: the ring wraps, tiers demote
    bad = []
    for t in range(STEPS):
        plane.put(_step(rank, t))
        if t < 20:
            plane.flush()
            continue
        b = plane.fetch(16)
        ids, ends = b["id"], b["done"] | b["truncated"]
        assert ids.shape == (16, 5)
        for row, end in zip(ids.tolist(), ends.tolist()):
            where = [_decode(i) for i in row]
            same = len({(r, e) for r, e, _ in where}) == 1
            steps = [s for _, _, s in where]
            if not same or steps != list(range(steps[0], steps[0] + 5)) or any(end[:-1]):
                bad.append(str(row))
        assert torch.equal(b["_index"] >> 48, ids[:, 0] // 1_000_000)  # the owner's rank
    plane.close()
    return bad


def test_slices_never_cross_an_episode_end_wrap_tier_or_shard():
    res = run_ranks(_slices, 3, timeout_s=240)
    assert all(not bad for bad in res.values()), res


def _nstep(rank: int, world: int) -> list[str]:
    seq = cd.Windows(n_step=3, gamma=GAMMA, stream="env", truncated="truncated")
    plane = _plane(seq, 64)
    bad = []
    for t in range(STEPS):
        plane.put(_step(rank, t))
        if t < 6:
            plane.flush()
            continue
        b = plane.fetch(32, oversample=True)
        for i, last, ret, disc in zip(
            b["id"].tolist(), b["_last_id"].tolist(), b["_return"].tolist(),
            b["_discount"].tolist(),
        ):  # fmt: skip
            want = _reference(i, 3)
            if (
                last != want[0]
                or not math.isclose(ret, want[1], rel_tol=1e-5)
                or not (math.isclose(disc, want[2], rel_tol=1e-6, abs_tol=1e-7))
            ):
                bad.append(f"{i}: got {(last, ret, disc)}, expected {want}")
    plane.close()
    return bad


def test_nstep_values_match_a_single_process_reference():
    res = run_ranks(_nstep, 2, timeout_s=180)
    assert all(not bad for bad in res.values()), {r: b[:5] for r, b in res.items()}


def test_slices_are_uniform_over_valid_starts():
    """One rank: every valid start (a full window inside one episode) is drawn equally often."""
    seq = cd.Windows(length=3, stream="env", truncated="truncated")
    plane = _plane(seq, 400)
    for t in range(60):
        plane.put(_step(0, t))
    counts: dict[int, int] = {}
    for _ in range(40):
        for i in plane.fetch(500, oversample=True)["id"][:, 0].tolist():
            counts[i] = counts.get(i, 0) + 1
    valid = [
        _item(0, e, t)
        for e in range(ENVS)
        for t in range(58)
        if not any(any(_ends(0, e, t + k)) for k in range(2))
    ]
    assert set(counts) == set(valid)
    n = sum(counts.values())
    exp = n / len(valid)
    chi2 = sum((counts[i] - exp) ** 2 / exp for i in valid)
    df = len(valid) - 1
    assert chi2 < df + 5 * math.sqrt(2 * df), (chi2, df)
    plane.close()


def test_sequence_errors_name_the_field():
    spec = cd.ExperienceSpec(FIELDS)
    with pytest.raises(ConfigError, match="sequence.stream"):
        cd.DataPlane(spec, 8, sampler=cd.Prioritized(sequence=cd.Windows(length=2, stream="x")))
    with pytest.raises(ConfigError, match="n_step=3 draws single items"):
        cd.Windows(length=4, n_step=3)
    with pytest.raises(ConfigError, match="sequence.gamma"):
        cd.Windows(n_step=2, gamma=1.5)
    with pytest.raises(ConfigError, match="sequence.done"):
        other = cd.ExperienceSpec({"x": ((), torch.float32)})
        cd.DataPlane(other, 8, sampler=cd.Prioritized(sequence=cd.Windows(length=2)))


@pytest.mark.parametrize("mode", ["slices", "nstep"])
def test_windows_stay_whole_when_a_small_ring_evicts_mid_stream(mode):
    """Uneven streams, random put sizes and a ring of 23 slots: a window whose older items were
    evicted (their slots reused by newer items, whose links they now hold) is never drawn, and
    every delivered window is whole (found by review: the walk back once crossed a reused slot)."""
    rng = random.Random(3)
    if mode == "slices":
        seq = cd.Windows(length=4, burn_in=1, stream="env", truncated="truncated")
    else:
        seq = cd.Windows(n_step=3, gamma=GAMMA, stream="env", truncated="truncated")
    plane = _plane(seq, 23)
    steps, ends, bad = [0, 0, 0], {}, []
    for _ in range(200):
        n = rng.choice([1, 2, 3, 5, 12, 30])
        env = [rng.randrange(3) for _ in range(n)]
        ids = []
        for e in env:
            i = e * 100_000 + steps[e]
            steps[e] += 1
            u = rng.random()
            ends[i] = (u < 0.1, 0.1 <= u < 0.15)
            ids.append(i)
        plane.put({
            "id": torch.tensor(ids), "env": torch.tensor(env), "reward": torch.ones(n),
            "done": torch.tensor([ends[i][0] for i in ids]),
            "truncated": torch.tensor([ends[i][1] for i in ids]),
        })  # fmt: skip
        try:
            b = plane.fetch(16)
        except cd.EmptyStoreError:
            continue
        if mode == "slices":
            for row in b["id"].tolist():
                broken = any(row[k + 1] != row[k] + 1 for k in range(4))
                if broken or any(any(ends[i]) for i in row[:-1]):
                    bad.append(row)
        else:
            for i, last in zip(b["id"].tolist(), b["_last_id"].tolist()):
                m = last - i
                cut = m < 2 and not any(ends[last])
                if not 0 <= m <= 2 or cut or any(any(ends[i + k]) for k in range(m)):
                    bad.append((i, last))
    plane.close()
    assert not bad, bad[:5]


def _draws(
    seq: cd.Windows, stream_dtype: torch.dtype, steps: int, capacity: int = 48, batch: int = 8
) -> list[dict]:
    """One process: puts of 3 streams with episode ends, the ring wrapping, a fetch per step;
    a state_dict round trip halfway (the stream table restored)."""
    fields = {**FIELDS, "env": ((), stream_dtype)}
    plane = cd.DataPlane(
        cd.ExperienceSpec(fields), capacity, seed=3, schedule="sync",
        sampler=cd.Prioritized(alpha=0.0, beta=0.0, eps=0.0, sequence=seq),
    )  # fmt: skip
    out = []
    for t in range(steps):
        b = _step(0, t)
        b["env"] = b["env"].to(stream_dtype)
        plane.put(b)
        if t == steps // 2:
            sampler = plane._p.sampler
            sampler.load_state_dict(sampler.state_dict())
        if t >= 8:
            out.append({k: v.clone() for k, v in plane.fetch(batch, oversample=True).items()})
    plane.close()
    return out


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.int16])
@pytest.mark.parametrize(
    "seq",
    [
        cd.Windows(n_step=3, gamma=GAMMA, stream="env", truncated="truncated"),
        cd.Windows(length=3, burn_in=1, stream="env"),
    ],
    ids=["nstep", "slices"],
)
def test_native_links_and_nstep_rows_match_the_torch_path(monkeypatch, seq, dtype):
    """``seq_link``/``seq_nstep``/``unpack_rows`` (the C loops) give the torch path's batches,
    item for item."""
    from conduit_dist.sampling import sequences

    needs_native("seq_link", "seq_nstep", "unpack_rows", "seq_starts")
    fast = _draws(seq, dtype, 60)
    monkeypatch.setattr(sequences, "_native", None)
    slow = _draws(seq, dtype, 60)
    assert len(fast) == len(slow) == 52
    for a, b in zip(fast, slow):
        assert a.keys() == b.keys()
        for k in a:  # the native unpack's fields too: same dtypes, each its own contiguous copy
            assert a[k].dtype == b[k].dtype and a[k].is_contiguous(), k
            if k == "_return":
                torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-6)
            else:
                assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("capacity", [5, 7])
def test_native_starts_match_the_torch_path_in_rings_that_reuse_slots_every_step(
    monkeypatch, capacity
):
    """A ring of a few slots: every step's items overwrite the windows the walks back cross, so
    ``seq_starts`` must check each link's liveness as the torch path does."""
    from conduit_dist.sampling import sequences

    needs_native("seq_starts")
    seq = cd.Windows(n_step=3, gamma=GAMMA, stream="env", truncated="truncated")
    fast = _draws(seq, torch.int64, 60, capacity=capacity, batch=4)
    monkeypatch.setattr(sequences, "_native", None)
    slow = _draws(seq, torch.int64, 60, capacity=capacity, batch=4)
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a["id"], b["id"]) and torch.equal(a["_last_id"], b["_last_id"])


def test_nstep_rows_of_a_spec_past_the_native_table_unpack_through_torch():
    """130 more fields: the n-step outputs (first, last, return, discount) outgrow the native
    unpack's table of 256, and those batches come through the torch path, whole."""
    extra = {f"f{i}": torch.full((ENVS,), float(i)) for i in range(130)}
    seq = cd.Windows(n_step=3, gamma=GAMMA, stream="env", truncated="truncated")
    spec = cd.ExperienceSpec.from_batch({**_step(0, 0), **extra})
    plane = cd.DataPlane(spec, 256, seed=0, sampler=cd.Prioritized(alpha=0.0, sequence=seq))
    for t in range(40):
        plane.put({**_step(0, t), **extra})
    b = plane.fetch(6)
    plane.close()
    assert b["f129"].tolist() == [129.0] * 6 and b["_last_f7"].tolist() == [7.0] * 6
    assert b["_discount"].shape == (6,) and len(b) > 256


def test_nstep_batches_reuse_their_buffers_only_once_dropped():
    """The learner's n-step fields, ``_index`` and ``_weight`` land in pooled buffers: a batch
    still held is never written by a later fetch, and once batches are dropped a fetch and its
    round allocate no tensor (what the main job's loop does every iteration)."""
    from conduit_dist.bench.rounds import TensorAllocations
    from conduit_dist.records.buffers import use_count

    if use_count(torch.zeros(1)) is None:
        pytest.skip("this torch exposes no storage use counts: every batch gets a fresh buffer")
    seq = cd.Windows(n_step=3, gamma=GAMMA, stream="env", truncated="truncated")
    plane = cd.DataPlane(
        cd.ExperienceSpec(FIELDS), 512, seed=1, sampler=cd.Prioritized(alpha=0.6, sequence=seq)
    )
    for t in range(60):
        plane.put(_step(0, t))
    held = plane.fetch(16)
    kept = {k: v.clone() for k, v in held.items()}
    others = [plane.fetch(16) for _ in range(3)]  # the pool is full of held buffers: evicts
    for _ in range(8):  # fetches while `held` is held
        b = plane.fetch(16)
        mine = {v.untyped_storage().data_ptr() for v in held.values()}
        assert not mine & {v.untyped_storage().data_ptr() for v in b.values()}
        plane.update_priorities(b["_index"], torch.rand(16))
    assert all(torch.equal(held[k], kept[k]) for k in kept)  # never overwritten
    for k, v in held.items():  # and right: the reference's n-step values
        if k == "_return":
            want = [_reference(int(i), 3)[1] for i in held["id"]]
            assert torch.allclose(v, torch.tensor(want), atol=1e-4)
    del held, b, others
    for t in range(60, 64):  # warm: the pool's buffers are free again
        plane.put(_step(0, t))
        plane.fetch(16)
    steps = [_step(0, t) for t in range(64, 96)]
    prios = torch.rand(16, dtype=torch.float32)
    with TensorAllocations() as allocs:
        for step in steps:
            plane.put(step)
            b = plane.fetch(16)
            plane.update_priorities(b["_index"], prios)
            del b
    # a batch size first fetched under inference mode (an evaluation: its pooled buffers are
    # made then) leaves later batches of that size trainable
    with torch.inference_mode():
        frozen = plane.fetch(12)
    del frozen
    b = plane.fetch(12)
    assert not any(v.is_inference() for v in b.values())
    w = torch.ones(12, requires_grad=True)
    (w * b["_weight"] * b["_return"]).sum().backward()  # autograd saves them
    plane.close()
    assert allocs.count == 0, allocs.count


def test_seq_starts_matches_a_reference_walk_on_random_links():
    """``seq_starts`` against the walk ``Episodes._starts`` describes, on random links with
    broken ones, slots reused by newer items and episode ends: each new item's start ``L - 1``
    live links back, then (n-step) the items ``0 .. L - 2`` links before each new item that
    ends an episode; only live starts, in that order."""
    from conduit_dist.records.spec import _native as native

    needs_native("seq_starts")
    g = torch.Generator().manual_seed(0)

    def back(prev, gen, cap, x, steps):
        for _ in range(steps):
            p = int(prev[x % cap])
            if p < 0 or int(gen[p % cap]) != p:
                return -1
            x = p
        return x

    for trial in range(300):
        cap, L = (
            int(torch.randint(1, 12, (1,), generator=g)),
            int(torch.randint(1, 6, (1,), generator=g)),
        )
        gen = torch.randint(-1, 3 * cap, (cap,), generator=g)
        prev = torch.randint(-2, 3 * cap, (cap,), generator=g)
        end = torch.rand(cap, generator=g) < 0.3
        gens = torch.randint(
            0, 3 * cap, (int(torch.randint(0, 9, (1,), generator=g)),), generator=g
        )
        for cut in (False, True):
            n = gens.numel()
            out = torch.full((n * L + 1,), -7, dtype=torch.int64)  # one canary past the room
            k = native.seq_starts(
                prev.data_ptr(), gen.data_ptr(), end.data_ptr(), cap, gens.data_ptr(), n, L,
                cut, out.data_ptr(),
            )  # fmt: skip
            want = [back(prev, gen, cap, int(x), L - 1) for x in gens]
            if cut:
                ends = [int(x) for x in gens if bool(end[int(x) % cap])]
                want += [back(prev, gen, cap, x, b) for b in range(L - 1) for x in ends]
            want = [s for s in want if s >= 0 and int(gen[s % cap]) == s]
            assert out[:k].tolist() == want, (trial, cut)
            assert int(out[-1]) == -7
