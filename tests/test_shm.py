"""Host rows through shared memory (``TransportConfig(shared_memory=True)``): the same bytes as
gloo's all-to-all for any split matrix (uneven, empty, growing past the file's halves), the same
batches as a plane without it, the files gone after ``close``, bad values refused."""

from __future__ import annotations

import os
import time

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
    # splits past the buffers are refused before anything is copied or anyone arrives (the
    # copies run on raw addresses), and the next exchange runs as before
    inp = (torch.arange(2 * world, dtype=torch.uint8) + 10 * rank).view(world, 2)
    out = torch.zeros(world, 2, dtype=torch.uint8)
    refused = ""
    try:
        shm.shm.start(out, inp, [2] * world, [3] * world)
    except ValueError as exc:
        refused = str(exc)
    shm.all_to_all(out, inp, [1] * world, [1] * world, 99)
    after = out[:, 0].tolist() == [10 * p + 2 * rank for p in range(world)]
    shm.close()
    ref.close()
    return {
        "bad": bad,
        "gens": sorted(gens),
        "during": during,
        "token": token,
        "refused": refused,
        "after": after,
    }


def test_shared_memory_all_to_all_moves_gloos_bytes_and_removes_its_files():
    res = run_ranks(_same_bytes_as_gloo, 3)
    for rank, r in res.items():
        assert r["bad"] == [], (rank, r["bad"])
        assert len(r["gens"]) > 1, r["gens"]  # the large exchanges made larger files
        # every file was unlinked at the exchange after the one that made it (the peers had
        # mapped it): nothing named in /dev/shm while the exchanges run
        assert r["during"] == [], r["during"]
        assert f"on rank {rank}: splits [3, 3, 3] of 2-byte rows in" in r["refused"], r
        assert r["after"], r
    assert _files(res[0]["token"]) == []  # nor after close


def _landing(rank: int, world: int) -> dict[str, object]:
    """Each source's block reversed in 3-byte runs by land(), this rank's own included, then a
    run past a block refused before anything is copied."""
    import numpy as np

    from conduit_dist.collectives.exchange import Exchange

    ex = Exchange(30, name="land", shared_memory=True)
    k = 12  # bytes from each rank to each rank
    inp = torch.tensor([(17 * rank + 3 * d + i) % 256 for d in range(world) for i in range(k)],
                       dtype=torch.uint8)  # fmt: skip
    out = torch.zeros(world * k, dtype=torch.uint8)  # unused: the runs land in `dest`
    dest = torch.zeros(world * k, dtype=torch.uint8)
    spans = {}
    for p in range(world):  # block p's runs of 3 bytes in reverse order, at p's place in dest
        runs = [(dest.data_ptr() + p * k + (k - 3 - off), off, 3) for off in range(0, k, 3)]
        spans[p] = np.asarray(runs, dtype=np.int64)
    ex.land(spans)
    ex.all_to_all(out, inp, [k] * world, [k] * world, 0)
    expect = []
    for p in range(world):
        block = [(17 * p + 3 * rank + i) % 256 for i in range(k)]
        expect += [b for off in reversed(range(0, k, 3)) for b in block[off : off + 3]]
    ex.land({p: np.asarray([[dest.data_ptr(), k - 2, 3]], dtype=np.int64) for p in range(world)})
    refused = ""
    try:
        ex.all_to_all(out, inp, [k] * world, [k] * world, 1)
    except Exception as exc:
        refused = str(exc)
    landed = ex.shm.landed
    # both refused their own runs before arriving; the peer may still be mapping this rank's
    # file of exchange 0 (a rank closing here would remove it under the peer)
    torch.distributed.barrier()
    ex.close()
    return {"same": dest.tolist() == expect, "untouched": not out.any().item(),
            "refused": refused, "landed": landed}  # fmt: skip


def test_land_copies_each_sources_rows_run_by_run_and_refuses_runs_past_a_block():
    for rank, got in run_ranks(_landing, 2).items():
        assert got["same"] and got["untouched"], (rank, got)
        assert "landing run" in got["refused"] and "outside its 12-byte block" in got["refused"]
        assert got["landed"] >= 1


def _closed_after_arriving(rank: int, world: int) -> str:
    """Rank 1 arrives at an exchange that made its file, then closes before rank 0 maps it:
    rank 0's wait names rank 1 and why, not a bare missing path."""
    from conduit_dist.collectives.exchange import Exchange

    ex = Exchange(30, name="gone", shared_memory=True)
    inp = torch.full((world, 4), rank, dtype=torch.uint8)
    out = torch.zeros(world, 4, dtype=torch.uint8)
    work = ex.shm.start(out, inp, [], [])  # the first exchange makes each rank's file
    said = ""
    if rank == 1:
        ex.close()
        torch.distributed.barrier()
    else:
        torch.distributed.barrier()  # rank 1 has closed: its file is gone
        try:
            work.wait()
        except RuntimeError as exc:
            said = str(exc)
        ex.close()
    return said


def test_a_peer_closing_before_its_file_is_mapped_is_named():
    said = run_ranks(_closed_after_arriving, 2)[0]
    assert "rank 1's file of generation 1 was removed before this rank mapped it" in said, said
    assert "closed its plane or exited after arriving" in said


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
        # with it, the all-to-alls went through its files (fused: in place, as lent)
        mem = plane._p.exchange.shm
        used = (mem.exchanges, mem.in_place) if mem is not None else None
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
        exchanges, in_place = got[True][2]
        assert got[False][2] is None and exchanges >= 12, got[True][2]
        if placement == "local":  # every header exchange wrote its rows where they go (a
            # round whose candidates fell short delivers with one more exchange, copied in)
            assert in_place >= 12, got[True][2]


def _open_and_close(rank: int, world: int) -> list[str]:
    spec = cd.ExperienceSpec.from_batch({"x": torch.zeros(1, 3)})
    shm = cd.TransportConfig(shared_memory=True)
    tokens = []
    for fetches in (0, 1, 0, 2):  # closed at once: peers open every file in the closing round
        plane = cd.DataPlane(spec, 64, seed=1, schedule="sync", transport=shm)
        tokens.append(plane._p.exchange.shm.token)
        plane.put({"x": torch.full((4, 3), float(rank))})
        for _ in range(fetches):
            plane.fetch(4)
        plane.close()
    return tokens


def test_planes_closed_at_once_leave_no_file_and_fail_no_peer():
    tokens = run_ranks(_open_and_close, 3)[0]
    assert all(_files(t) == [] for t in tokens), [_files(t) for t in tokens]


def _dies(rank: int, world: int) -> object:
    plane = cd.DataPlane(
        cd.ExperienceSpec.from_batch({"x": torch.zeros(1, 3)}), 64, seed=1, schedule="sync",
        transport=cd.TransportConfig(shared_memory=True, timeout_s=3.0),
    )  # fmt: skip
    for it in range(4):
        if rank == 1 and it == 2:
            os._exit(3)
        plane.put({"x": torch.zeros(4, 3)})
        start = time.monotonic()
        try:
            plane.fetch(4)
        except cd.RoundError as exc:
            waited = time.monotonic() - start
            return exc.round, list(exc.ranks), plane._p.exchange.shm.token, str(exc), waited
    return "no error"


def test_a_dead_peer_fails_the_round_at_once_naming_it():
    got = run_ranks(_dies, 2, collective_timeout_s=3.0, expect_exit={1: 3})[0]
    left = _files(got[2])
    for f in left:  # (removed whatever the assertions say)
        os.unlink(os.path.join(SHM_DIR, f))
    assert got[:2] == (2, [1]), got
    assert "ranks [1] exited (or closed their plane) before arriving" in got[3], got[3]
    assert got[4] < 2.0, got  # seen gone, not waited out (timeout 3 s)
    # os._exit skips every clean-up, yet the killed rank's files were unlinked long before
    assert left == [], left


def _late(rank: int, world: int) -> object:
    from conduit_dist.collectives.exchange import Exchange

    ex = Exchange(1.5, name="late", shared_memory=True)
    rows = torch.zeros(4, 8, dtype=torch.uint8)
    ex.all_to_all(torch.empty_like(rows), rows, [2] * world, [2] * world, 0)
    error = None
    if rank == 1:
        time.sleep(2.5)  # alive, holding its lock, but past rank 0's timeout
    else:
        try:
            ex.all_to_all(torch.empty_like(rows), rows, [2] * world, [2] * world, 1)
        except cd.RoundError as exc:
            error = str(exc)
        try:  # out of step with its peer now: refused, not run
            ex.all_to_all(torch.empty_like(rows), rows, [2] * world, [2] * world, 2)
        except cd.RoundError as exc:
            error = (error, str(exc))
    ex.close()
    return error


def _interrupted(rank: int, world: int) -> object:
    import signal
    import threading

    from conduit_dist.collectives.exchange import Exchange

    ex = Exchange(30, name="int", shared_memory=True)
    rows = torch.zeros(4, 8, dtype=torch.uint8)
    got = None
    if rank == 1:
        time.sleep(2.0)  # late; rank 0 is interrupted meanwhile and never exchanges
    else:
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        start = time.monotonic()
        try:
            ex.all_to_all(torch.empty_like(rows), rows, [2] * world, [2] * world, 0)
        except KeyboardInterrupt:
            got = time.monotonic() - start
    ex.close()
    return got


def test_ctrl_c_ends_a_wait_for_a_peer_without_waiting_for_the_timeout():
    waited = run_ranks(_interrupted, 2)[0]
    assert waited is not None and waited < 1.5, waited  # the timeout is 30 s


def test_a_late_peer_fails_the_exchange_at_the_timeout_naming_it():
    error, again = run_ranks(_late, 2)[0]
    assert "timed out after 1.5s on rank 0: ranks [1] never arrived" in error, error
    assert "an earlier collective of the plane failed (all_to_all in round 1)" in again, again


def _full(rank: int, world: int) -> dict[str, object]:
    import errno

    from conduit_dist.collectives.exchange import Exchange

    ex = Exchange(10, name="full", shared_memory=True)
    token = ex.shm.token
    rows = torch.zeros(8, 16, dtype=torch.uint8)
    ex.all_to_all(torch.empty_like(rows), rows, [4] * world, [4] * world, 0)  # files made
    if rank == 1:  # this rank's /dev/shm is full from now on

        def full(fd, offset, length):
            raise OSError(errno.ENOSPC, "No space left on device")

        os.posix_fallocate = full
    big = torch.zeros(2 << 20, 16, dtype=torch.uint8)  # 32 MiB: rank 1 must grow its file
    try:
        ex.all_to_all(torch.empty_like(big), big, [1 << 20] * world, [1 << 20] * world, 1)
        error = None
    except cd.RoundError as exc:
        error = str(exc)
    ex.close()
    return {"error": error, "token": token}


def test_a_full_dev_shm_fails_the_exchange_on_every_rank_naming_the_rank():
    res = run_ranks(_full, 2)
    assert "rank 1 could not reserve" in res[1]["error"], res[1]["error"]
    assert "ranks [1] could not make room" in res[0]["error"], res[0]["error"]
    assert _files(res[0]["token"]) == []  # nothing half-made is left


def _mismatched(rank: int, world: int) -> str:
    with pytest.raises(ConfigError) as got:
        cd.DataPlane(cd.ExperienceSpec.from_batch({"x": torch.zeros(1, 3)}), 64,
                     transport=cd.TransportConfig(shared_memory=rank == 0))  # fmt: skip
    return str(got.value)


def test_ranks_that_disagree_are_refused_on_every_rank_by_rank():
    for msg in run_ranks(_mismatched, 2).values():
        assert "ranks [1] set False, ranks [0] set True; expected the same" in msg, msg


def _auto(
    rank: int, world: int, room: bool, native: bool, apart: bool = False
) -> dict[str, object]:
    import logging

    from conduit_dist.collectives import shm_open

    if apart:  # each rank its own torchrun node: two hosts by their keys, one /dev/shm
        os.environ["GROUP_RANK"] = str(rank)

    # more than any /dev/shm has free, or nothing: the decision on every machine, CI's too
    shm_open.startup_bytes = lambda world: 0
    shm_open.MARGIN = 0 if room else 1 << 62
    if not native:
        shm_open._native = None
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("conduit_dist").addHandler(handler)
    logging.getLogger("conduit_dist").setLevel(logging.INFO)
    spec = cd.ExperienceSpec.from_batch({"x": torch.zeros(1, 3)})
    plane = cd.DataPlane(spec, 64, seed=1, schedule="sync")  # shared_memory="auto"
    plane.put({"x": torch.full((4, 3), float(rank))})
    batch = plane.fetch(4)["x"]
    on = plane._p.exchange.shm is not None
    used = plane._p.exchange.shm.exchanges if on else 0
    plane.close()
    refused = None
    if not native:
        with pytest.raises(ConfigError) as got:
            cd.DataPlane(spec, 64, transport=cd.TransportConfig(shared_memory=True))
        refused = str(got.value)
    return {"on": on, "used": used, "rows": batch.shape[0], "said": said, "refused": refused}


def test_auto_is_on_on_one_host_with_room_and_off_saying_why_otherwise():
    for r in run_ranks(_auto, 2, True, True).values():
        assert r["on"] and r["rows"] == 4 and r["used"] > 0, r  # one host, room: on
    short = run_ranks(_auto, 2, False, True)
    assert not any(r["on"] for r in short.values()), short
    assert any("MiB free, less than" in m for m in short[0]["said"]), short[0]
    assert short[1]["said"] == []  # said once, by rank 0
    hosts = run_ranks(_auto, 2, True, True, True)
    assert not any(r["on"] for r in hosts.values()), hosts
    assert any("ranks [1] are on other hosts" in m for m in hosts[0]["said"]), hosts[0]
    bare = run_ranks(_auto, 2, True, False)
    assert not any(r["on"] for r in bare.values()), bare
    assert any("ranks [0, 1] lack the native barrier" in m for m in bare[0]["said"]), bare[0]
    for r in bare.values():  # required, it is refused instead
        assert "ranks [0, 1] lack the native barrier" in r["refused"], r


def _malformed_node(rank: int, world: int) -> str:
    if rank == 1:
        os.environ["GROUP_RANK"] = "x"  # what host_key refuses: one rank only
    with pytest.raises(ConfigError) as got:
        cd.DataPlane(cd.ExperienceSpec.from_batch({"x": torch.zeros(1, 3)}), 64)
    return str(got.value)


def test_a_malformed_node_index_on_one_rank_fails_every_rank_alike():
    for rank, msg in run_ranks(_malformed_node, 2).items():
        assert "ranks [1]: their node index variable is malformed" in msg, (rank, msg)


def test_bad_values_are_refused():
    with pytest.raises(
        ConfigError, match=r"transport.shared_memory: expected one of \['auto', True, False\]"
    ):
        cd.TransportConfig(shared_memory="yes")
