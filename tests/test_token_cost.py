"""A token plane balanced by cost, with a token cap: the cost table and its refusals, costs
computed at put, a group over the cap refused by name with nothing stored, and the cap never
exceeded end to end over random long-tailed lengths, at world size 1 and on 2 gloo ranks
(every group delivered whole, byte-identical, exactly once; the same count on every learner)."""

from __future__ import annotations

import hashlib
import math
import subprocess

import numpy as np
import pytest
import torch
from dist_utils import ROOT, TORCHRUN, bench_line, child_env, run_ranks

import conduit_dist as cd
from conduit_dist.tokens.cost import COSTS, Flops

MAX_LEN = 256


def make_spec(group_size: int = 4) -> cd.TokenSpec:
    return cd.TokenSpec(
        {
            "tokens": cd.Ragged(torch.int32, MAX_LEN),
            "logprobs": cd.Ragged(torch.float32, MAX_LEN),
            "reward": ((), torch.float32),
        },
        group_size=group_size,
    )


def lengths_of(gid: int, size: int) -> list[int]:
    """Group ``gid``'s lengths: lognormal (median 24, sigma 1.2), 5% of them 128-256."""
    rng = np.random.default_rng(gid)
    lengths = np.clip(rng.lognormal(math.log(24), 1.2, size), 1, MAX_LEN).astype(np.int64)
    tail = rng.random(size) < 0.05
    lengths[tail] = rng.integers(128, MAX_LEN + 1, int(tail.sum()))
    return lengths.tolist()


def member(gid: int, m: int, length: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(gid * 131 + m)
    return {
        "tokens": torch.randint(0, 50_000, (length,), dtype=torch.int32, generator=gen),
        "logprobs": -torch.rand(length, generator=gen),
        "reward": torch.rand((), generator=gen),
    }


def group_batch(gids: list[int], size: int, lengths: list[list[int]] | None = None):
    """Whole groups as one put (packed fields and lengths)."""
    lengths = lengths or [lengths_of(g, size) for g in gids]
    seqs = [member(g, m, ls[m]) for g, ls in zip(gids, lengths, strict=True) for m in range(size)]
    batch = {k: torch.cat([s[k] for s in seqs]) for k in ("tokens", "logprobs")}
    batch["reward"] = torch.stack([s["reward"] for s in seqs])
    batch["group"] = torch.tensor(gids).repeat_interleave(size)
    return batch, torch.tensor([ls for group in lengths for ls in group])


def digest(f: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in ("tokens", "logprobs", "reward"):
        h.update(f[k].contiguous().numpy().tobytes())
    return h.hexdigest()


def received(mbs: list[cd.MicroBatch]) -> list[dict[str, object]]:
    """Per micro-batch: its index, tokens and each sequence's (group, digest)."""
    out = []
    for mb in mbs:
        cu = mb.cu_seqlens.tolist()
        seqs = []
        for i in range(mb.sequences):
            f = {k: mb[k][cu[i] : cu[i + 1]] for k in ("tokens", "logprobs")}
            f["reward"] = mb["reward"][i]
            seqs.append((int(mb["group"][i]), digest(f)))
        out.append({"index": list(mb.index), "tokens": mb.tokens, "seqs": seqs})
    return out


# ---------------------------------------------------------------------- the cost table


def test_flops_defaults_are_one_layer_of_width_4096():
    f = Flops()
    assert (f.a, f.b) == (12 * 4096, 1) and f == Flops.for_model(4096)
    assert Flops.for_model(1024, causal=False) == Flops(6 * 1024, 1)
    assert f(np.array([1, 8192])).tolist() == [49_153, 49_152 * 8192 + 8192**2]  # exact int64
    assert Flops(1.5, 0.25)(np.array([3])).tolist() == [7]  # 6.75, rounded
    assert list(COSTS) == ["tokens", "flops"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cost": "flop"}, r"cost: expected one of \['tokens', 'flops'\], a Flops\(a, b\) or a "
                           r"callable L -> cost, got 'flop'"),
        ({"cost": 3}, r"cost: expected one of \['tokens', 'flops'\]"),
        ({"cost": lambda n: 0.2}, r"returned 0.2; a sequence's cost must round to an int"),
        ({"cost": lambda n: 2.0**62}, r"returned"),
        ({"token_cap": 3}, r"token_cap: expected None or an int >= group_size = 4"),
        ({"token_cap": True}, r"token_cap: expected None or an int"),
    ],
)  # fmt: skip
def test_a_bad_cost_or_cap_is_refused_naming_the_allowed_ones(kwargs, match):
    with pytest.raises(cd.ConfigError, match=match):
        cd.TokenPlane(make_spec(), 64, 8192, **kwargs)


def test_bad_flops_coefficients_are_refused():
    with pytest.raises(cd.ConfigError, match=r"Flops.a: expected a finite number >= 0, got -1"):
        Flops(a=-1)
    with pytest.raises(cd.ConfigError, match=r"Flops: expected a \+ b >= 1"):
        Flops(a=0, b=0.25)
    with pytest.raises(cd.ConfigError, match="d_model"):
        Flops.for_model(0)


# ---------------------------------------------------------------------- costs at put


@pytest.mark.parametrize(
    ("cost", "expect"),
    [
        ("tokens", lambda n: n),
        ("flops", lambda n: 49_152 * n + n * n),
        (Flops(a=10, b=2), lambda n: 10 * n + 2 * n * n),
        (lambda n: n**1.5, lambda n: round(n**1.5)),
    ],
)
def test_a_groups_cost_is_its_sequences_costs_summed_at_put(cost, expect):
    with cd.TokenPlane(make_spec(), 64, 8192, cost=cost) as tp:
        tp.put(*group_batch([3, 4], 4))
        for g in (3, 4):
            assert tp.store.groups[g].cost == sum(expect(n) for n in lengths_of(g, 4))
        mbs = tp.fetch(2, 1024)
        assert sorted({s[0] for r in received(mbs) for s in r["seqs"]}) == [3, 4]


def test_a_callable_cost_that_fails_on_a_length_refuses_the_put():
    def cost(n: int) -> float:
        return math.nan if 100 <= n < 200 else n

    with cd.TokenPlane(make_spec(), 64, 8192, cost=cost) as tp:
        gid = next(g for g in range(1000) if any(100 <= n < 200 for n in lengths_of(g, 4)))
        with pytest.raises(cd.SpecError, match=r"\(\d+\) returned nan"):
            tp.put(*group_batch([gid], 4))
        assert tp.stats()["sequences"] == 0


# ---------------------------------------------------------------------- the cap at put


def test_a_group_over_the_cap_is_refused_by_name_and_nothing_is_stored():
    with cd.TokenPlane(make_spec(), 64, 8192, token_cap=200) as tp:
        big = [[100, 60, 50, 40]]  # 250 tokens
        msg = (
            r"group 7: 250 tokens \(0 stored \+ 250 in this put\) exceed token_cap = 200, the "
            r"most one micro-batch may hold \(a group is never split\); nothing of this put"
        )
        with pytest.raises(cd.SpecError, match=msg):
            tp.put(*group_batch([6, 7], 4, [[10, 10, 10, 10], *big]))
        assert tp.stats()["sequences"] == 0 and not tp.store.groups
        # members one by one: the third takes it over the cap; the two stored are dropped
        batch, lengths = group_batch([7], 4, big)
        cut = [0, *np.cumsum(lengths.tolist()).tolist()]

        def one(m: int):
            return {k: (v[cut[m] : cut[m + 1]] if k in ("tokens", "logprobs") else v[m : m + 1])
                    for k, v in batch.items()}, lengths[m : m + 1]  # fmt: skip

        tp.put(*one(0))
        tp.put(*one(1))
        with pytest.raises(cd.SpecError, match=r"210 tokens \(160 stored \+ 50 .* its 2 stored"):
            tp.put(*one(2))
        assert 7 not in tp.store.groups
        s = tp.stats()
        assert (s["sequences"], s["evicted_groups"], s["evicted_sequences"]) == (0, 1, 2)
        tp.put(*one(3))  # a late member of the dropped group: dropped and counted
        assert tp.stats()["sequences"] == 0 and tp.stats()["evicted_sequences"] == 3
        # a refused put drops the reservations of its groups
        tp.reserve([8, 9])
        with pytest.raises(cd.SpecError, match="group 9: 250 tokens"):
            tp.put(*group_batch([8, 9], 4, [[10, 10, 10, 10], *big]))
        assert 8 not in tp.store.groups and 9 not in tp.store.groups
        tp.put(*group_batch([8], 4, [[10, 10, 10, 10]]))  # within the cap: stored
        assert tp.stats()["sequences"] == 4


def test_a_budget_above_the_cap_is_refused_in_the_round():
    with cd.TokenPlane(make_spec(), 64, 8192, token_cap=400) as tp:
        tp.put(*group_batch([0], 4, [[10, 10, 10, 10]]))
        with pytest.raises(cd.ConfigError, match="token_budget: expected at most token_cap = 400"):
            tp.fetch(1, 500)
        assert [r["tokens"] for r in received(tp.fetch(1, 400))] == [40]


# ---------------------------------------------------------------------- the cap end to end


def _trial(rank: int, world: int, seed: int) -> dict[str, object]:
    """One random batch through a real plane: every rank's groups (long-tailed lengths, those
    over the cap left out), put a few per round by ``produce`` while learners stream, or all
    first and fetched. Returns what this learner received and what every rank put."""
    rng = np.random.default_rng(seed)
    size = int(rng.choice([1, 2, 4, 8]))
    cost = [None, "flops", Flops.for_model(64), lambda n: n * n][seed % 4] or "tokens"
    tokens = {g: sum(lengths_of(g, size)) for g in range(seed * 1000, seed * 1000 + 400)}
    cap = max(size * 8, int(np.quantile(list(tokens.values()), rng.uniform(0.7, 1.0))))
    budget = max(1, int(cap * rng.uniform(0.3, 1.0)))
    ok = [g for g, t in tokens.items() if t <= cap]
    n = int(rng.integers(1, 13)) * world
    mine = [g for j, g in enumerate(ok[:n]) if j % world == rank]
    streaming = bool(rng.integers(0, 2))
    todo, pace = list(mine), np.random.default_rng([seed, rank])

    def produce() -> None:  # one to three of this rank's groups a round, its own pace
        k = int(pace.integers(1, 4))
        take, todo[:] = todo[:k], todo[k:]
        if take:
            tp.put(*group_batch(take, size))

    with cd.TokenPlane(make_spec(size), 4096, 1 << 20, cost=cost, token_cap=cap) as tp:
        if streaming:
            mbs = list(tp.stream(n, budget, produce=produce, wait_s=60))
        else:
            tp.put(*group_batch(mine, size))
            mbs = tp.fetch(n, budget, wait_s=60)
        put = {g: sorted(digest(member(g, m, ln)) for m, ln in enumerate(lengths_of(g, size)))
               for g in mine}  # fmt: skip
    return {"mbs": received(mbs), "cap": cap, "put": put, "n": n}


def _trials(rank: int, world: int, seeds: list[int]) -> list[dict[str, object]]:
    return [_trial(rank, world, s) for s in seeds]


def _check_trial(per_rank: list[dict[str, object]]) -> None:
    cap = per_rank[0]["cap"]
    got: dict[int, list[str]] = {}
    pieces = []
    for r in per_rank:
        counts = []
        for mb in r["mbs"]:
            assert 0 < mb["tokens"] <= cap, f"a micro-batch of {mb['tokens']} over the cap {cap}"
            assert mb["seqs"]  # none empty
            if mb["index"][0] == 0:
                counts.append(mb["index"][1])
            groups = {g for g, _ in mb["seqs"]}
            for g in groups:  # a group whole in one micro-batch, delivered once
                assert g not in got, f"group {g} delivered twice or split"
                got[g] = sorted(d for h, d in mb["seqs"] if h == g)
        pieces.append(counts)
    assert all(p == pieces[0] for p in pieces)  # the same count on every learner, every piece
    put = {g: d for r in per_rank for g, d in r["put"].items()}
    assert got == put  # every group, byte-identical, exactly once
    assert len(got) == per_rank[0]["n"]


def test_the_cap_is_never_exceeded_end_to_end_at_world_size_one():
    for seed in range(24):
        _check_trial([_trial(0, 1, seed)])


def test_the_cap_is_never_exceeded_end_to_end_on_two_ranks():
    seeds = list(range(100, 116))
    res = run_ranks(_trials, 2, seeds, timeout_s=240)
    for t in range(len(seeds)):
        _check_trial([res[0][t], res[1][t]])


# ---------------------------------------------------------------------- the bench


@pytest.mark.parametrize("learner", ["sleep", "matmul"])
def test_bench_tokens_learner_cost_reports_step_time_balance(learner):
    """``bench tokens --cost flops --learner-cost sleep|matmul`` (bench/token_balance.py) runs
    under torchrun and reports its keys; the modelled compute balance (no timing in it) is best
    by flops, and the planes' micro-batches stay within the cap (values, not timings,
    asserted)."""
    cmd = [*TORCHRUN, "-m", "conduit_dist.bench", "tokens", "--cost", "flops",
           "--learner-cost", learner, "--groups-per-rank", "8", "--samples", "3",
           "--warmup", "0", "--step-ms", "5", "--d-model", "1024", "--matmul-width", "8",
           "--median", "64"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = bench_line(proc.stdout)
    assert line["bench"] == "token_balance" and line["world"] == 2 and line["cost"] == "flops"
    assert line["learner_cost"] == learner
    s = line["summary"]
    for pre in ("", "tokens_", "equal_counts_"):
        for key in ("step_time_max_over_mean", "cost_max_over_mean", "step_ms_mean"):
            assert s[pre + key] > 0, pre + key
    assert s["cost_max_over_mean"] <= s["tokens_cost_max_over_mean"] + 1e-9
    assert s["cost_max_over_mean"] <= s["equal_counts_cost_max_over_mean"] + 1e-9
    assert s["max_micro_batch_tokens"] <= s["token_cap"]
    assert s["tokens_max_micro_batch_tokens"] <= s["token_cap"]
