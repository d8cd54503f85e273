"""Token experience beyond consume-once: uniform and prioritized replay of whole groups, the
ExperienceLoader streaming micro-batches from a TokenPlane, and the refusals that point a
ragged spec to the token plane."""

from __future__ import annotations

import collections

import pytest
import torch
from dist_utils import run_ranks
from test_tokens import G, check_whole, group_batch, make_spec

import conduit_dist as cd


def _replay(rank: int, world: int, kind: str) -> dict[str, object]:
    with cd.TokenPlane(make_spec(), 64, 16_384, replay=kind, alpha=1.0, seed=3) as tp:
        tp.put(*group_batch([g for g in range(6) if g % world == rank]))
        counts: collections.Counter[int] = collections.Counter()
        for it in range(40):
            mbs = tp.fetch(2, 10_000)
            for mb in mbs:
                check_whole([mb]) if len(mbs) == 1 else None
                gids = mb["group"][::G].tolist()  # one entry per group
                counts.update(gids)
                if kind == "prioritized" and it == 0:  # group 5 ten times as likely
                    pr = torch.where(mb["group"] == 5, 10.0, 1.0)
                    tp.update_priorities(mb, pr)
                elif kind == "prioritized":
                    tp.update_priorities(mb, torch.where(mb["group"] == 5, 10.0, 1.0))
        return {"counts": dict(counts), "stored": tp.stats()["sequences"]}


@pytest.mark.parametrize("kind", ["uniform", "prioritized"])
def test_replay_keeps_groups_and_draws_by_priority(kind):
    res = run_ranks(_replay, 2, kind)
    total: collections.Counter[int] = collections.Counter()
    for r in res.values():
        total.update(r["counts"])
        assert r["stored"] == 3 * G  # replay keeps every group
    assert sum(total.values()) == 40 * 2 and set(total) <= set(range(6))
    share5 = total[5] / sum(total.values())
    if kind == "uniform":
        assert 0.05 < share5 < 0.35  # 1/6 expected (2 distinct of 6 per draw: 1/3 per draw)
    else:
        assert share5 > 0.4  # priority 10 against 1: drawn in most global batches


def _loader(rank: int, world: int) -> dict[str, object]:
    tp = cd.TokenPlane(make_spec(), 64, 16_384)
    gids = iter(range(rank * 1000, rank * 1000 + 1000))

    def collect():  # one group per round on each rank: generation continues while training
        return group_batch([next(gids)])

    policy = torch.nn.Linear(2, 2)
    loader = cd.ExperienceLoader(tp, batch_size=4, token_budget=200, collect=collect, rounds=3,
                                 model=policy)  # fmt: skip
    counts, seen = [], set()
    piece: list[cd.MicroBatch] = []
    for mb in loader:
        piece = [mb] if mb.index[0] == 0 else [*piece, mb]
        if mb.index[0] == mb.index[1] - 1:
            seen |= set(check_whole(piece))
            counts.append(len(piece))
    tp.close()
    return {"counts": counts, "groups": len(seen), "batches": loader.rounds_run,
            "version": tp.version}  # fmt: skip


def test_experience_loader_streams_token_micro_batches():
    res = run_ranks(_loader, 2)
    assert res[0]["counts"] == res[1]["counts"]  # the same micro-batch counts, piece by piece
    assert res[0]["groups"] + res[1]["groups"] == 3 * 4  # 3 global batches of 4 groups
    assert all(r["batches"] == 3 and r["version"] == 3 for r in res.values())


def test_a_ragged_spec_is_pointed_to_the_token_plane():
    with pytest.raises(cd.SpecError, match="cd.TokenPlane"):
        cd.ExperienceSpec({"tokens": cd.Ragged(torch.int32, 16), "r": ((), torch.float32)})
    with pytest.raises(cd.ConfigError, match="cd.TokenPlane"):
        cd.DataPlane(make_spec(), capacity_per_rank=10)
    with pytest.raises(cd.ConfigError, match="replay: expected one of"):
        cd.TokenPlane(make_spec(), 64, 8192, replay="fifo")
