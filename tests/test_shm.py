"""Host rows through shared memory (``TransportConfig(shared_memory=True)``): the same bytes as
gloo's all-to-all for any split matrix (uneven, empty, growing past the file's halves), the same
batches as a plane without it, the files gone after ``close``, bad values refused."""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import run_ranks

import conduit_dist as cd
from conduit_dist.collectives.shm import SHM_DIR
from conduit_dist.errors import ConfigError


def _files(token: str | None = None) -> list[str]:
    return sorted(f for f in os.listdir(SHM_DIR) if f.startswith(f"conduit-{token or ''}"))


def _same_bytes_as_gloo(rank: int, world: int) -> dict[str, object]:
    from conduit_dist.collectives.exchange import Exchange

    shm, ref = Exchange(30, name="shm", shared_memory=True), Exchange(30, name="ref")
    token = shm.shm.token
    gen = torch.Generator().manual_seed(0)  # the same matrices on every rank
    gens, bad = set(), []
    for it in range(40):
        top = 4000 if it in (7, 21) else 40  # two large exchanges: the files grow
        m = torch.randint(0, top, (world, world), generator=gen)
        if it % 5 == 0:
            m[(it // 5) % world] = 0  # a rank that sends nothing
        if it % 9 == 0:
            m[:, (it // 9) % world] = 0  # a rank that receives nothing
        width = 24 if it % 2 else 8
        inp = (torch.arange(int(m[rank].sum()) * width) % 251 + rank).to(torch.uint8)
        inp = inp.view(-1, width)
        outs = [torch.full((int(m[:, rank].sum()), width), 7, dtype=torch.uint8) for _ in "ab"]
        for ex, out in zip((shm, ref), outs):
            ex.all_to_all(out, inp, m[:, rank].tolist(), m[rank].tolist(), it)
        if not torch.equal(*outs):
            bad.append(it)
        gens.add(shm.shm.gen)
    during = _files(token)
    shm.close()
    ref.close()
    return {"bad": bad, "gens": sorted(gens), "during": during, "token": token}


def test_shared_memory_all_to_all_moves_gloos_bytes_and_removes_its_files():
    res = run_ranks(_same_bytes_as_gloo, 3)
    for rank, r in res.items():
        assert r["bad"] == [], (rank, r["bad"])
        assert len(r["gens"]) > 1, r["gens"]  # the large exchanges made larger files
        mine = [f for f in r["during"] if f.split("-")[2] == str(rank)]
        assert len(mine) == 1, r["during"]  # older generations were removed on the way
    assert _files(res[0]["token"]) == []  # and the last ones at close


def _batches(rank: int, world: int, placement: str, strategy: str) -> dict[bool, list]:
    spec = cd.ExperienceSpec.from_batch({"id": torch.zeros(1, dtype=torch.int64),
                                         "obs": torch.zeros(1, 20)})  # fmt: skip
    got = {}
    for shm in (False, True):
        plane = cd.DataPlane(
            spec, 4096, seed=3, placement=placement, schedule="sync",
            transport=cd.TransportConfig(shared_memory=shm, strategy=strategy),
        )  # fmt: skip
        ids = []
        for it in range(12):
            n = 40 + 17 * ((it + rank) % 3)  # uneven puts
            i = torch.arange(n) + 1000 * it + 100_000 * rank
            plane.put({"id": i, "obs": i[:, None].float().expand(n, 20)})
            b = plane.fetch(32)
            assert torch.equal(b["obs"], b["id"][:, None].float().expand(32, 20))
            ids.append(b["id"].tolist())
        # with it, the exchanges went through its files (a generation was written)
        used = plane._p.exchange.shm is not None and plane._p.exchange.shm.gen >= 1
        got[shm] = (plane.schedule, ids, used)
        plane.close()
    return got


@pytest.mark.parametrize(
    ("placement", "strategy"), [("local", "auto"), ("round_robin", "all_to_all")]
)
def test_a_plane_over_shared_memory_delivers_the_same_batches(placement, strategy):
    for rank, got in run_ranks(_batches, 3, placement, strategy).items():
        assert got[True][:2] == got[False][:2], rank
        assert got[True][0] == ("fused" if placement == "local" else "general")
        assert got[True][2] and not got[False][2]


def test_bad_values_are_refused():
    with pytest.raises(ConfigError, match="transport.shared_memory: expected True or False"):
        cd.TransportConfig(shared_memory="yes")
