"""Token experience on 3 gloo ranks: ragged sequences delivered byte-identical, groups whole,
equal micro-batch counts with none empty, pacing by version with nothing stale delivered or
dropped, and buffered groups restored whole onto another world size."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from dist_utils import run_ranks

import conduit_dist as cd

G, MAX_LEN = 4, 96


def make_spec() -> cd.TokenSpec:
    return cd.TokenSpec(
        {
            "tokens": cd.Ragged(torch.int32, MAX_LEN),
            "logprobs": cd.Ragged(torch.float32, MAX_LEN),
            "loss_mask": cd.Ragged(torch.bool, MAX_LEN),
            "reward": ((), torch.float32),
        },
        group_size=G,
    )


def member(gid: int, m: int) -> dict[str, torch.Tensor]:
    """Sequence ``m`` of group ``gid``: its content follows from the two ids alone."""
    gen = torch.Generator().manual_seed(gid * 131 + m)
    n = int(torch.randint(1, MAX_LEN + 1, (1,), generator=gen))
    return {
        "tokens": torch.randint(0, 50_000, (n,), dtype=torch.int32, generator=gen),
        "logprobs": -torch.rand(n, generator=gen),
        "loss_mask": torch.rand(n, generator=gen) > 0.3,
        "reward": torch.rand((), generator=gen),
    }


def group_batch(gids: list[int], nested: bool = False):
    """Whole groups as one put: packed fields and lengths (or jagged nested tensors)."""
    seqs = [member(g, m) for g in gids for m in range(G)]
    lengths = torch.tensor([s["tokens"].shape[0] for s in seqs])
    batch = {
        k: torch.cat([s[k] for s in seqs])
        if not nested
        else torch.nested.nested_tensor([s[k] for s in seqs], layout=torch.jagged)
        for k in ("tokens", "logprobs", "loss_mask")
    }
    batch["reward"] = torch.stack([s["reward"] for s in seqs])
    batch["group"] = torch.tensor(gids).repeat_interleave(G)
    return batch, (None if nested else lengths)


def digest(fields: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in ("tokens", "logprobs", "loss_mask", "reward"):
        h.update(fields[k].contiguous().numpy().tobytes())
    return h.hexdigest()


def sequences(mb: cd.MicroBatch) -> list[tuple[int, dict[str, torch.Tensor]]]:
    """(group id, fields) of each sequence of a micro-batch, cut at ``cu_seqlens``."""
    cu = mb.cu_seqlens.tolist()
    out = []
    for i in range(mb.sequences):
        f = {k: mb[k][cu[i] : cu[i + 1]] for k in ("tokens", "logprobs", "loss_mask")}
        f["reward"] = mb["reward"][i]
        out.append((int(mb["group"][i]), f))
    return out


def check_whole(mbs: list[cd.MicroBatch]) -> dict[int, list[str]]:
    """Every sequence identical to one put of its group; groups whole in one micro-batch."""
    seen: dict[int, list[str]] = {}
    for k, mb in enumerate(mbs):
        assert mb.index == (k, len(mbs)) and mb.sequences > 0  # none empty
        for gid, f in sequences(mb):
            assert gid not in seen or seen[gid][0] == k, f"group {gid} split"
            seen.setdefault(gid, [k]).append(digest(f))
    for gid, d in seen.items():
        assert sorted(d[1:]) == sorted(digest(member(gid, m)) for m in range(G)), gid
    for mb in mbs:  # what the round knew on the host is what the sections carried
        assert mb.host["_key"].tolist() == mb["_key"].tolist()
        assert mb.host["_holder"].tolist() == mb["_holder"].tolist()
        assert mb.tokens == int(mb.cu_seqlens[-1])
    return {g: d[1:] for g, d in seen.items()}


def _deliver(rank: int, world: int, n_groups: int, budget: int) -> dict[str, object]:
    with cd.TokenPlane(make_spec(), 64, 8192) as tp:
        mine = [g for g in range(n_groups) if g % world == rank]
        if mine:  # producers put whole groups: packed on rank 0, jagged nested elsewhere
            tp.put(*group_batch(mine[:1], nested=rank > 0))
            if mine[1:]:
                tp.put(*group_batch(mine[1:]))
        try:
            mbs = tp.fetch(n_groups, budget)
        except cd.ConfigError as exc:
            return {"error": str(exc)}
        seen = check_whole(mbs)
        return {"count": len(mbs), "groups": sorted(seen), "tokens": sum(m.tokens for m in mbs),
                "stats": tp.stats()}  # fmt: skip


@pytest.mark.parametrize(("n_groups", "budget"), [(7, 150), (3, 10_000), (12, 400)])
def test_delivery_is_byte_identical_whole_and_balanced(n_groups, budget):
    res = run_ranks(_deliver, 3, n_groups, budget)
    assert len({r["count"] for r in res.values()}) == 1  # the same micro-batch count
    got = sorted(g for r in res.values() for g in r["groups"])
    assert got == list(range(n_groups))  # every group once, on one learner
    wire = sum(r["stats"]["wire_bytes"] for r in res.values())
    data = sum(r["stats"]["token_bytes"] for r in res.values())
    assert data <= wire <= data * 1.05 + 64 * 3 * 8  # no padding: column alignment at most


def test_fewer_groups_than_learners_is_refused_on_every_rank():
    res = run_ranks(_deliver, 3, 1, 1000)
    for r in res.values():
        assert "cannot give each of 3 learners a group" in r["error"]


def _streaming_paced(rank: int, world: int) -> dict[str, object]:
    """Learner 0 streams global batches of 4 groups; ranks 1 and 2 generate paced by version
    (max_policy_age=1), at different speeds; every consumed row's age is checked."""
    age, per_batch, steps = 1, 4, 6
    tp = cd.TokenPlane(make_spec(), 64, 16_384, learner_ranks=[0], producer_ranks=[1, 2],
                       max_policy_age=age, groups_per_batch=per_batch)  # fmt: skip
    policy = torch.nn.Linear(2, 2)
    ages, pieces, gid = [], [], rank * 1_000_000
    if rank == 0:
        for _ in range(steps):
            got: list[list[cd.MicroBatch]] = []
            for mb in tp.stream(per_batch, 300):
                ages += (tp.newest - mb["_version"]).tolist()
                got.append([mb]) if mb.index[0] == 0 else got[-1].append(mb)
            for piece in got:  # each delivered piece: groups whole, micro-batches counted
                check_whole(piece)
            pieces.append(len(got))
            tp.publish_weights(policy)
    else:
        while (v := tp.reserve([gid], model=policy)) is not None:
            batch, lengths = group_batch([gid])
            for m in range(G):  # members arrive one by one, a round between them
                sl = slice(int(lengths[:m].sum()), int(lengths[: m + 1].sum()))
                part = {k: (t[sl] if k in ("tokens", "logprobs", "loss_mask") else t[m : m + 1])
                        for k, t in batch.items()}  # fmt: skip
                tp.put(part, lengths[m : m + 1], version=v)
                if rank == 2 and not tp.flush():  # the slower producer
                    break
                if not tp.flush():
                    break
            gid += 1
    stats = tp.stats()
    tp.close()
    return {"ages": ages, "pieces": pieces, "stats": stats, "started": tp.pacer.started}


def test_pacing_keeps_every_row_within_the_bound_and_drops_nothing():
    res = run_ranks(_streaming_paced, 3, timeout_s=150)
    ages = res[0]["ages"]
    assert ages and max(ages) <= 1 and min(ages) >= 0
    for r in res.values():
        assert r["stats"]["stale_evicted"] == 0 and r["stats"]["evicted_groups"] == 0
    assert res[0]["stats"]["delivered_groups"] == 6 * 4
    assert any(p > 1 for p in res[0]["pieces"])  # streamed: a batch arrived in pieces
    # paced: neither producer ran more than (newest + age + 1) x its share of a batch ahead
    assert all(res[r]["started"] <= (6 + 1 + 1) * 2 for r in (1, 2))


def _ckpt(rank: int, world: int, root: str, phase: str) -> dict[str, object]:
    with cd.TokenPlane(make_spec(), 64, 8192) as tp:
        if phase == "save":
            mine = [g for g in range(10) if g % world == rank]
            tp.put(*group_batch(mine))
            partial, lengths = group_batch([100 + rank])  # an incomplete group: not kept
            keep = slice(0, int(lengths[:2].sum()))
            tp.put({k: (v[keep] if v.shape[0] == int(lengths.sum()) else v[:2])
                    for k, v in partial.items()}, lengths[:2])  # fmt: skip
            tp.checkpoint(root)
            return {}
        tp.restore(root)
        st = tp.store  # restored groups get fresh keys; their ids are in the group field
        held = sorted(int(st.fixed["group"][g.slots[0]]) for g in st.groups.values())
        mbs = tp.fetch(10, 500)
        return {"held": held, "seen": sorted(check_whole(mbs))}


def test_checkpoint_of_buffered_groups_restores_whole_onto_fewer_ranks(tmp_path):
    run_ranks(_ckpt, 3, str(tmp_path), "save")
    res = run_ranks(_ckpt, 2, str(tmp_path), "restore")
    held = [g for r in res.values() for g in r["held"]]
    assert sorted(held) == list(range(10))  # each complete group on exactly one new rank
    assert sorted(g for r in res.values() for g in r["seen"]) == list(range(10))


def test_bad_input_names_the_field_and_stores_nothing():
    with cd.TokenPlane(make_spec(), 64, 8192) as tp:
        batch, lengths = group_batch([0])
        bad = dict(batch, logprobs=batch["logprobs"].clone())
        bad["logprobs"][3] = float("nan")
        with pytest.raises(cd.SpecError, match="'logprobs': expected finite values, got 1 NaN"):
            tp.put(bad, lengths)
        with pytest.raises(cd.SpecError, match=r"lengths: expected every length in \[1, 96\]"):
            tp.put(batch, torch.cat([lengths[:-1], torch.tensor([MAX_LEN + 1])]))
        with pytest.raises(cd.SpecError, match="'tokens': expected dtype torch.int32"):
            tp.put(dict(batch, tokens=batch["tokens"].long()), lengths)
        with pytest.raises(cd.SpecError, match="group 0: expected at most group_size = 4"):
            tp.put(*group_batch([0, 0]))
        assert tp.stats()["sequences"] == 0
        tp.put(batch, lengths)
        assert tp.stats()["sequences"] == G


def test_a_nan_error_says_how_many_values_and_where_the_first_are():
    hidden = cd.Ragged(torch.float32, 8, (2,))  # two values per token
    spec = cd.TokenSpec({"tokens": cd.Ragged(torch.int32, 8), "hidden": hidden,
                         "reward": ((), torch.float32)})  # fmt: skip
    lengths = torch.tensor([3, 5, 2, 4])  # sequence 1 starts at token 3, sequence 3 at 10
    batch = {"tokens": torch.zeros(14, dtype=torch.int32), "hidden": torch.zeros(14, 2),
             "reward": torch.zeros(4), "group": torch.arange(4)}  # fmt: skip
    batch["hidden"][[4, 4, 10, 12, 13], [0, 1, 1, 0, 0]] = float("nan")  # two in token 4
    with cd.TokenPlane(spec, 8, 64) as tp:
        with pytest.raises(cd.SpecError) as err:
            tp.put(batch, lengths)
        assert str(err.value).startswith(
            "field 'hidden': expected finite values, got 5 NaN/inf in 4 of 14 tokens, first at "
            "sequence 1 token 1, sequence 3 token 0, sequence 3 token 2, ..."
        ), err.value
        reward = torch.tensor([0, 1, float("inf"), 0])
        with pytest.raises(cd.SpecError, match="got 1 NaN/inf in 1 of 4 sequences") as err:
            tp.put(dict(batch, hidden=torch.zeros(14, 2), reward=reward), lengths)
        assert str(err.value).endswith("first at sequence 2"), err.value
        assert tp.stats()["sequences"] == 0


def test_capacity_in_tokens_evicts_oldest_groups_whole():
    with cd.TokenPlane(make_spec(), 64, 2 * G * MAX_LEN) as tp:
        for g in range(6):
            tp.put(*group_batch([g]))
        s = tp.stats()
        assert s["evicted_groups"] >= 1 and s["evicted_sequences"] == G * s["evicted_groups"]
        assert sorted(tp.store.groups) == list(range(s["evicted_groups"], 6))
        mbs = tp.fetch(6 - s["evicted_groups"], 10_000)
        assert sorted(check_whole(mbs)) == list(range(s["evicted_groups"], 6))


def test_per_token_versions_count_the_oldest_token():
    with cd.TokenPlane(make_spec(), 64, 8192, max_policy_age=0) as tp:
        batch, lengths = group_batch([0])
        tv = torch.full((int(lengths.sum()),), 3, dtype=torch.int64)
        tv[0] = 2  # generation of sequence 0 spanned a weight update
        tp.put(batch, lengths, token_versions=tv)
        assert tp.store.groups[0].version == 2
        assert np.array_equal(tp.store.version[tp.store.groups[0].slots], [2, 3, 3, 3])


def _one_learner(rank: int, world: int, strategy: str) -> dict[str, object]:
    """Learner 0 takes every holder's groups; the others only produce (any strategy moves the
    byte rows, the gather strategy included: one hot destination is its best case)."""
    transport = cd.TransportConfig(strategy=strategy)
    with cd.TokenPlane(make_spec(), 64, 8192, learner_ranks=[0], transport=transport) as tp:
        tp.put(*group_batch([rank * 10, rank * 10 + 1]))
        if rank == 0:
            return {"seen": sorted(check_whole(tp.fetch(2 * world, 400)))}
        tp.flush()
        return {"seen": []}


@pytest.mark.parametrize("strategy", ["all_to_all", "gather", "p2p"])
def test_one_learner_takes_every_holders_groups_whatever_the_strategy(strategy):
    res = run_ranks(_one_learner, 3, strategy)
    assert res[0]["seen"] == [0, 1, 10, 11, 20, 21]


def _same_ids(rank: int, world: int, root: str, phase: str) -> dict[str, object]:
    with cd.TokenPlane(make_spec(), 64, 8192) as tp:
        if phase == "save":
            tp.put(*group_batch([5]))  # group ids only need to be new on their own rank
            tp.checkpoint(root)
            return {}
        tp.restore(root)
        mbs = tp.fetch(2, 10_000)
        return {"sequences": sum(mb.sequences for mb in mbs), "groups": len(tp.store.groups)}


def test_restore_keeps_groups_whole_when_ranks_used_the_same_ids(tmp_path):
    run_ranks(_same_ids, 2, str(tmp_path), "save")
    res = _same_ids(0, 1, str(tmp_path), "restore")  # both groups 5 onto one rank
    assert res == {"sequences": 2 * G, "groups": 0}


def test_members_of_a_group_evicted_before_it_completed_are_dropped_and_counted():
    with cd.TokenPlane(make_spec(), 2 * G, 8192) as tp:
        batch, lengths = group_batch([0])
        half = int(lengths[:2].sum())
        part = {
            k: (v[:half] if v.shape[0] == int(lengths.sum()) else v[:2]) for k, v in batch.items()
        }
        tp.put(part, lengths[:2])  # group 0: 2 of 4 members
        tp.put(*group_batch([1]))
        tp.put(*group_batch([2]))  # no room: group 0 (incomplete, oldest) goes
        assert sorted(tp.store.groups) == [1, 2] and tp.stats()["evicted_groups"] == 1
        rest = {
            k: (v[half:] if v.shape[0] == int(lengths.sum()) else v[2:]) for k, v in batch.items()
        }
        tp.put(rest, lengths[2:])  # its late members: dropped, not a new group 0
        assert sorted(tp.store.groups) == [1, 2] and tp.stats()["evicted_sequences"] == G
        assert sorted(check_whole(tp.fetch(2, 10_000))) == [1, 2]


def test_bad_priorities_and_a_foreign_checkpoint_are_refused(tmp_path):
    with cd.TokenPlane(make_spec(), 64, 8192, replay="prioritized") as tp:
        tp.put(*group_batch([0]))
        (mb,) = tp.fetch(1, 10_000)
        with pytest.raises(cd.SpecError, match="finite priorities >= 0"):
            tp.update_priorities(mb, torch.full((G,), -1.0))
        tp.checkpoint(str(tmp_path))
    other = cd.TokenSpec({"tokens": cd.Ragged(torch.int32, MAX_LEN)}, group_size=G)
    with cd.TokenPlane(other, 64, 8192) as tp, pytest.raises(cd.CheckpointError, match="spec"):
        tp.restore(str(tmp_path))


def test_review_cases_refused_or_unblocked():
    batch, _ = group_batch([0], nested=True)
    flipped = torch.nested.nested_tensor(list(reversed(list(batch["logprobs"].unbind()))),
                                         layout=torch.jagged)  # fmt: skip
    with cd.TokenPlane(make_spec(), 64, 8192) as tp:
        assert not torch.equal(flipped.offsets(), batch["logprobs"].offsets())
        with pytest.raises(cd.SpecError, match="'logprobs': its sequence lengths"):
            tp.put(dict(batch, logprobs=flipped))
        assert tp.stats()["sequences"] == 0
    # a group that never completes, older than the bound, no longer holds a place for ever
    with cd.TokenPlane(make_spec(), 64, 8192, max_policy_age=0) as tp:
        part, lens = group_batch([9])
        tp.put({k: v[: int(lens[0])] if v.shape[0] == int(lens.sum()) else v[:1]
                for k, v in part.items()}, lens[:1])  # fmt: skip
        tp.publish_weights()
        tp.put(*group_batch([1]), version=1)
        assert sorted(check_whole(tp.fetch(1, 10_000, wait_s=5))) == [1]
        assert tp.stats()["stale_evicted"] == 1
    paced = cd.TokenPlane(make_spec(), 64, 8192, max_policy_age=1, groups_per_batch=2)
    with paced as tp, pytest.raises(cd.ConfigError, match="groups_per_batch = 2"):
        tp.fetch(4, 10_000)
    with cd.TokenPlane(make_spec(), 64, MAX_LEN) as tp:  # room for one longest sequence only
        big, lens = group_batch([3])
        with pytest.raises(cd.SpecError, match="exceed this shard's capacity"):
            for m in range(G):  # members one by one: the group outgrows the arena
                a, b = int(lens[:m].sum()), int(lens[: m + 1].sum())
                tp.put({k: (v[a:b] if v.shape[0] == int(lens.sum()) else v[m : m + 1])
                        for k, v in big.items()}, lens[m : m + 1])  # fmt: skip


def _over(rank: int, world: int, shm) -> dict[str, object]:
    """The same groups delivered with the sections through /dev/shm or gloo's sockets."""
    transport = cd.TransportConfig(shared_memory=shm)
    with cd.TokenPlane(make_spec(), 64, 8192, transport=transport) as tp:
        tp.put(*group_batch([g for g in range(9) if g % world == rank]))
        seen = check_whole(tp.fetch(9, 300))
        mem = tp.ex.shm
        return {"seen": sorted((g, sorted(d)) for g, d in seen.items()),
                "shm": mem.exchanges if mem is not None else 0,
                "in_place": mem.in_place if mem is not None else 0,
                "landed": mem.landed if mem is not None else 0}  # fmt: skip


def test_sections_go_through_shared_memory_on_one_host_and_arrive_the_same():
    via_shm = run_ranks(_over, 2, True)
    via_gloo = run_ranks(_over, 2, False)
    for rank in (0, 1):
        assert via_shm[rank]["shm"] > 0 and via_gloo[rank]["shm"] == 0
        assert via_shm[rank]["in_place"] > 0  # the sections were packed into shared memory
        assert via_shm[rank]["landed"] > 0  # and landed straight in the micro-batches' columns
        assert via_shm[rank]["seen"] == via_gloo[rank]["seen"]  # byte for byte, whole


def _spans(rank: int, world: int, native: bool) -> dict[str, object]:
    """Rank 0 puts members one at a time, groups interleaved, so its arena runs break at every
    sequence; rank 1 puts whole groups in order in one put, so its runs are long and cross
    from one destination's groups to the next's; a per-token field of inner shape (2, 3).
    ``native``: the holders copy token runs with the extension's copy_spans (host shards),
    else they gather by a token index."""
    import conduit_dist.tokens.deliver as D

    calls = [0]
    if not native:
        D._native = None
    else:  # counted, so that a path that stopped taking the spans would fail the test

        class Spy:
            def __getattr__(self, name, real=D._native):
                return getattr(real, name)

            def copy_spans(self, spans, real=D._native):
                calls[0] += 1
                return real.copy_spans(spans)

        D._native = Spy()
    fields = {
        "tokens": cd.Ragged(torch.int32, MAX_LEN),
        "h": cd.Ragged(torch.float16, MAX_LEN, inner=(2, 3)),
        "reward": ((), torch.float32),
    }
    spec = cd.TokenSpec(fields, group_size=G)
    tp = cd.TokenPlane(spec, 256, 8192, seed=5)
    gids = [rank * 100 + i for i in range(12)]
    truth = {}
    if rank == 0:  # member-major, one at a time
        order, step = [(g, m) for m in range(G) for g in gids], 1
    else:  # group-major, all at once
        order, step = [(g, m) for g in gids for m in range(G)], len(gids) * G
    for i in range(0, len(order), step):
        seqs = []
        for g, m in order[i : i + step]:
            n = 1 + (g * 7 + m * 3) % 9
            gen = torch.Generator().manual_seed(g * 31 + m)
            f = {
                "tokens": torch.randint(0, 9999, (n,), dtype=torch.int32, generator=gen),
                "h": torch.randn(n, 2, 3, generator=gen).half(),
                "reward": torch.rand(()),
            }
            truth.setdefault(g, []).append(digest_h(f))
            seqs.append((g, f))
        lengths = torch.tensor([f["tokens"].shape[0] for _, f in seqs])
        batch = {k: torch.cat([f[k] for _, f in seqs]) for k in ("tokens", "h")}
        batch["reward"] = torch.stack([f["reward"] for _, f in seqs])
        batch["group"] = torch.tensor([g for g, _ in seqs])
        tp.put(batch, lengths)
    got: dict[int, list[str]] = {}
    for mb in tp.fetch(12 * world, 40):
        cu = mb.cu_seqlens.tolist()
        for i in range(mb.sequences):
            f = {k: mb[k][cu[i] : cu[i + 1]] for k in ("tokens", "h")} | {"reward": mb["reward"][i]}
            got.setdefault(int(mb["group"][i]), []).append(digest_h(f))
    tp.close()
    return {"truth": {g: sorted(v) for g, v in truth.items()},
            "got": {g: sorted(v) for g, v in got.items()}, "spans": calls[0]}  # fmt: skip


def digest_h(f: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in ("tokens", "h", "reward"):
        h.update(f[k].reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("native", [True, False], ids=["spans", "index"])
def test_token_runs_copied_by_spans_or_gathered_by_index_arrive_the_same(native):
    if native:
        from dist_utils import needs_native

        needs_native("copy_spans")
    res = run_ranks(_spans, 2, native)
    assert all((r["spans"] > 0) == native for r in res.values()), res
    truth = {g: v for r in res.values() for g, v in r["truth"].items()}
    got: dict[int, list[str]] = {}
    for r in res.values():
        for g, v in r["got"].items():
            assert g not in got, f"group {g} delivered to two learners"
            got[g] = v
    assert got == truth


def _idle_holder(rank: int, world: int, strategy: str) -> dict[str, object]:
    """Rank 2 puts nothing: it has no section to send in the round (0 bytes lent by shared
    memory would be an empty tensor at address 0, which start() could not recognise)."""
    transport = cd.TransportConfig(strategy=strategy)
    with cd.TokenPlane(make_spec(), 64, 8192, transport=transport) as tp:
        if rank < 2:
            tp.put(*group_batch([rank * 10 + g for g in range(6)]))
        seen = check_whole(tp.fetch(12, 300))
        return {"groups": sorted(seen), "shm": tp.ex.shm is not None}


@pytest.mark.parametrize("strategy", ["auto", "all_to_all"])
def test_a_holder_with_nothing_to_send_takes_part_in_the_round(strategy):
    res = run_ranks(_idle_holder, 3, strategy)
    got = sorted(g for r in res.values() for g in r["groups"])
    assert got == sorted([g for g in range(6)] + [10 + g for g in range(6)])
    assert all(r["shm"] for r in res.values())
