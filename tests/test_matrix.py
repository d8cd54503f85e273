"""The support matrix: every sampler on every placement, on 3 gloo ranks and at world size 1,
checked for exactness the way the per-sampler tests do (chi-square against the target
distribution for random samplers, exactly once for queues and epochs, windows and n-step values
against a single-process reference), and with ``max_policy_age`` on each."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks
from matrix_helpers import (
    BETA,
    BURN_IN,
    ENVS,
    FIELDS,
    LENGTH,
    chi2_ok,
    decode,
    ends,
    intact,
    mass,
    nstep_window,
    prio,
    sampler,
    starts,
    step,
)

import conduit_dist as cd
from conduit_dist.errors import EmptyStoreError

KINDS = (
    "uniform", "stratified", "prioritized", "n_step", "slices", "queue", "lifo",
    "without_replacement",
)  # fmt: skip
PLACEMENTS = ("local", "round_robin", "bandwidth_aware")
STEPS, CAP, BATCH, WARM, ROUNDS = 20, 64, 24, 6, 24
ROUTED = ("prioritized", "n_step")


def _windows_ok(kind: str, b: dict[str, torch.Tensor]) -> list[str]:
    """Windows within one stream and episode; n-step values as the reference computes them."""
    bad = []
    if kind == "slices":
        for row in b["id"].tolist():
            r, e, t = decode(row[0])
            want = [r * 100_000 + e * 1_000 + t + k for k in range(LENGTH + BURN_IN)]
            if row != want or any(any(ends(i)) for i in row[:-1]):
                bad.append(f"slice {row}")
    if kind == "n_step":
        for i, last, ret, disc in zip(
            b["id"].tolist(), b["_last_id"].tolist(), b["_return"].tolist(),
            b["_discount"].tolist(),
        ):  # fmt: skip
            want = nstep_window(i, STEPS)
            if want is None or last != want[0] or abs(ret - want[1]) > 1e-4 * max(1, want[1]):
                bad.append(f"n-step {i}: {(last, ret, disc)} vs {want}")
            elif abs(disc - want[2]) > 1e-6:
                bad.append(f"n-step {i}: discount {disc} vs {want[2]}")
    return bad


def _combo(
    rank: int, world: int, kind: str, placement: str, shm: bool = False
) -> dict[str, object]:
    plane = cd.DataPlane(
        cd.ExperienceSpec(FIELDS), CAP, seed=11, sampler=sampler(kind), placement=placement,
        schedule="sync", transport=cd.TransportConfig(shared_memory=shm),
    )  # fmt: skip
    for t in range(STEPS):
        plane.put(step(rank, t))
        plane.flush()
    out: dict[str, object] = {"bad": [], "counts": {}, "stored": plane.stored}
    got: list[int] = []
    if kind in ("queue", "lifo", "without_replacement"):
        batch = 8
        for _ in range(200):  # plane.stored is replicated: every rank runs the same rounds
            if plane.stored < batch:
                break
            try:
                b = plane.fetch(batch)
            except EmptyStoreError:
                continue
            out["bad"] += [] if intact(b) else ["corrupted row"]
            got += b["id"].tolist()
        out["got"], out["left"] = got, plane.stored
    else:
        routed = kind in ROUTED
        for r in range(WARM + ROUNDS):
            b = plane.fetch(BATCH)
            first = b["id"] if b["id"].dim() == 1 else b["id"][:, 0]
            if routed:
                plane.update_priorities(b["_index"], prio(first))
            if r < WARM:
                continue
            out["bad"] += [] if intact(b) else ["corrupted row"]
            out["bad"] += _windows_ok(kind, b)
            if routed:  # importance weights with the global smallest mass
                m_min = min(mass(i) for i in starts(kind, world, STEPS))
                want = torch.tensor(
                    [(mass(i) / m_min) ** -BETA for i in first.tolist()], dtype=torch.float64
                )
                if not torch.allclose(b["_weight"].double(), want, rtol=1e-4):
                    out["bad"].append(f"weights {b['_weight'][:4]} vs {want[:4]}")
            for i in first.tolist():
                out["counts"][i] = out["counts"].get(i, 0) + 1
    out["schedule"] = plane.schedule
    mem = plane._p.exchange.shm
    out["shm"] = mem.exchanges if mem is not None else None  # exchanges through it
    plane.close()
    return out


def _check(kind: str, world: int, res: dict[int, dict[str, object]]) -> None:
    every = starts("uniform", world, STEPS)
    for rank, r in res.items():
        assert not r["bad"], (kind, rank, r["bad"][:5])
        assert r["stored"] == world * ENVS * STEPS, (kind, rank, r["stored"])
    if kind in ("queue", "lifo"):
        got = [i for r in res.values() for i in r["got"]]
        assert len(got) == len(set(got)), "an item was delivered twice"
        left = res[0]["left"]
        assert len(got) + left == len(every) and set(got) <= set(every) and left < 8
        return
    if kind == "without_replacement":  # two epochs: every item exactly twice, then gone
        got = [i for r in res.values() for i in r["got"]]
        assert sorted(got) == sorted(every * 2) and res[0]["left"] == 0
        return
    counts: dict[int, int] = {}
    for r in res.values():  # every learner's batches (stratified: their union) over rounds
        for i, n in r["counts"].items():
            counts[i] = counts.get(i, 0) + n
    support = starts(kind, world, STEPS)
    weights = [mass(i) for i in support] if kind in ROUTED else [1.0] * len(support)
    ok, why = chi2_ok(counts, support, weights)
    assert ok, (kind, why)


def _over_shm(kind: str, placement: str) -> bool:
    """Which transport a combination runs on: alternating, so every sampler and every placement
    runs over both gloo's sockets and shared memory."""
    return (KINDS.index(kind) + PLACEMENTS.index(placement)) % 2 == 0


def _matrix(rank: int, world: int) -> dict[tuple[str, str], dict[str, object]]:
    return {(k, p): _combo(rank, world, k, p, _over_shm(k, p)) for k in KINDS for p in PLACEMENTS}


def test_every_sampler_on_every_placement_is_exact_on_three_ranks():
    """8 samplers x 3 placements on 3 ranks, one plane each: all 24 work and are exact; every
    sampler and every placement runs over gloo and over shared memory (``_over_shm``)."""
    res = run_ranks(_matrix, 3, timeout_s=400)
    for kind in KINDS:  # each ran where it was meant to, on every rank
        for placement in PLACEMENTS:
            for got in res.values():
                used = got[(kind, placement)]["shm"]
                assert (used is not None and used > 0) == _over_shm(kind, placement), used
    worked = []
    for kind in KINDS:
        for placement in PLACEMENTS:
            _check(kind, 3, {rank: got[(kind, placement)] for rank, got in res.items()})
            worked.append((kind, placement))
    schedules = {p: res[0][(k, p)]["schedule"] for k in KINDS for p in PLACEMENTS}
    assert schedules == {"local": "fused", "round_robin": "general", "bandwidth_aware": "general"}
    print(f"support matrix: {len(worked)} of {len(KINDS) * len(PLACEMENTS)} combinations work")
    assert len(worked) == len(KINDS) * len(PLACEMENTS)


@pytest.mark.parametrize("kind", KINDS)
def test_every_sampler_at_world_size_one(kind):
    for placement in PLACEMENTS:
        _check(kind, 1, {0: _combo(0, 1, kind, placement)})


def _ages(rank: int, world: int) -> dict[tuple[str, str], tuple[list[int], int]]:
    """Every rank learns and publishes each round, so each round's items are one version newer;
    with max_policy_age=1 shards evict what falls behind, and no fetch returns a stale row.
    Slices publish every ``2 * LENGTH`` steps: a window of ``LENGTH`` steps a version apart
    would always hold a stale item, so none could ever be fetched (the check saw no age at all
    before it counted them), and with ``LENGTH`` steps between publishes episode ends leave
    too few whole windows."""
    net, out = torch.nn.Linear(2, 2), {}
    for kind in KINDS:
        for placement in ("local", "round_robin"):
            plane = cd.DataPlane(
                cd.ExperienceSpec(FIELDS), CAP, seed=3, sampler=sampler(kind),
                placement=placement, schedule="sync", max_policy_age=1,
            )  # fmt: skip
            oldest, batch = [], 1 if kind in ("queue", "lifo", "without_replacement") else 4
            every = 2 * LENGTH if kind == "slices" else 1
            for t in range(12 * every):  # queues: fewer items taken than put, so some go stale
                plane.put(step(rank, t))
                if (t + 1) % every:
                    continue
                plane.publish_weights(net)
                try:
                    b = plane.fetch(batch)
                    oldest.append(int(b["_version"].min()) - plane.policy_version)
                except EmptyStoreError:
                    pass
            # the ages seen: min(oldest, default=0) would pass a combination that fetched nothing
            out[(kind, placement)] = (oldest, plane.store_stats()["stale_evicted"])
            plane.close()
    return out


def test_max_policy_age_with_every_sampler():
    res = run_ranks(_ages, 3, timeout_s=300)
    for rank, got in res.items():
        for combo, (oldest, evicted) in got.items():
            assert len(oldest) >= 3, (rank, combo, oldest)  # ages were observed, not assumed
            assert min(oldest) >= -1, (rank, combo, oldest)  # never more than one version behind
            assert evicted > 0, (rank, combo)  # the shards did evict stale items


def _actors_to_learner(rank: int, world: int, placement: str) -> dict[str, object]:
    """Actors put n-step streams, the learner (rank 0) reads; the placement routes whole streams
    to shards (bandwidth_aware: fixed at the first round that stages and fetches)."""
    plane = cd.DataPlane(
        cd.ExperienceSpec(FIELDS), CAP, seed=5, sampler=sampler("n_step"), placement=placement,
        learner_ranks=[0], schedule="sync",
    )  # fmt: skip
    bad, drawn = [], 0
    for t in range(STEPS):
        if rank:
            plane.put(step(rank, t))
            plane.flush()
            continue
        try:
            b = plane.fetch(32)
        except EmptyStoreError:
            continue
        plane.update_priorities(b["_index"], prio(b["id"]))
        bad += _windows_ok("n_step", b) + ([] if intact(b) else ["corrupted row"])
        drawn += b["id"].numel()
    sizes = plane.sizes.tolist()
    plane.close()
    return {"bad": bad, "drawn": drawn, "sizes": sizes}


@pytest.mark.parametrize("placement", ["round_robin", "bandwidth_aware"])
def test_streams_routed_from_actors_keep_their_windows(placement):
    """Disaggregated n-step windows: streams of both actors land on shards they share with
    other ranks' streams (the learner's among them), and every window stays within its own
    stream and episode."""
    res = run_ranks(_actors_to_learner, 3, placement, timeout_s=200)
    assert not res[0]["bad"], res[0]["bad"][:5]
    assert res[0]["drawn"] > 0
    assert res[0]["sizes"][0] > 0, res[0]["sizes"]  # streams were routed to the learner's shard
