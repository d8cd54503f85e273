"""The device side of the tiers, as far as it runs on a CPU: gathers into ``out`` of any layout
(the path a tier on another device than ``out`` takes), records from any layout, the checkpoint
guard's (copy, event) pairs read back exactly while writes overwrite, the one CUDA device of a
shard, and device/pinned tiers refused on a machine without CUDA before anything is built.

What only runs on CUDA (streams, events, pinned staging, the synchronous D2H copies) is listed in
``conduit_dist/tiers/cuda.py``; ``scripts/gpu_check.sh`` exercises it on a GPU.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

import conduit_dist as cd
from conduit_dist.checkpoint.snapshot import ShardSnapshot
from conduit_dist.tiers import DiskTier, MemoryTier, Shard, TieredShard
from conduit_dist.tiers.cuda import WorkerStream, cuda_device, upload

RB = 24  # record bytes (a multiple of 8, as every record layout is)


def _records(ids) -> torch.Tensor:
    """``uint8 [n, RB]`` records whose every word is a function of the item's id."""
    ids = torch.as_tensor(ids, dtype=torch.int64)
    return (ids[:, None] * 1000 + torch.arange(RB // 8)).view(torch.uint8)


def _out(layout: str, n: int) -> torch.Tensor:
    """An ``out`` of ``[n, RB]`` in the given memory layout (all but the first not contiguous)."""
    if layout == "contiguous":
        return torch.zeros(n, RB, dtype=torch.uint8)
    if layout == "wider rows":
        return torch.zeros(n, RB + 16, dtype=torch.uint8)[:, 8 : 8 + RB]
    if layout == "every other row":
        return torch.zeros(2 * n, RB, dtype=torch.uint8)[::2]
    assert layout == "transposed"
    return torch.zeros(RB, n, dtype=torch.uint8).t()


LAYOUTS = ["contiguous", "wider rows", "every other row", "transposed"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["host", "disk"])
def test_a_tier_gathers_into_out_of_any_layout(kind, layout, tmp_path):
    tier = MemoryTier(10, RB) if kind == "host" else DiskTier(10, RB, str(tmp_path))
    tier.write(0, _records(range(10)))
    cases = [
        (torch.tensor([7, 2, 9, 0]), -1, [7, 2, 9, 0]),  # slots (the native loop)
        (torch.tensor([7, 2, 9], dtype=torch.int32), -1, [7, 2, 9]),  # index_select
        (torch.tensor([17, 12, 20]), 10, [7, 2, 0]),  # generations of a ring, lap base 10
    ]
    for slots, base, want in cases:
        out = _out(layout, len(slots))
        tier.gather(slots, out, base=base)
        assert torch.equal(out, _records(want)), (slots, base)
    out = _out(layout, 2)
    with pytest.raises(IndexError):
        tier.gather(torch.tensor([3, 10]), out)
    assert not out.any()  # checked before any copy
    tier.close()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("background", [False, True])
def test_shards_take_records_and_gather_into_any_layout(layout, background):
    wide = torch.zeros(15, RB + 8, dtype=torch.uint8)
    wide[:, :RB] = _records(range(15))
    ring = Shard(MemoryTier(8, RB))
    tiered = TieredShard([MemoryTier(4, RB), MemoryTier(8, RB)], background=background)
    for shard in (ring, tiered):
        shard.append(wide[:6, :RB])  # records from a strided view
        shard.append(wide[6:15, :RB])
        if background:
            shard.demote_ahead(3)
    # the ring keeps 7..14; the tiered shard 3..14 over both tiers (background: room for 3
    # made after the appends, so 11 and 12 went down too and 3, 4, 5 were evicted)
    gens = {ring: [14, 7, 9, 12], tiered: [14, 6, 10, 11, 8, 13]}
    for shard, want in gens.items():
        out = _out(layout, len(want))
        shard.gather(torch.tensor(want), out)
        assert torch.equal(out, _records(want)), (type(shard).__name__, want)
    tiered.settle()
    assert [r.size for r in tiered.rings] == ([1, 8] if background else [4, 8])
    ring.close()
    tiered.close()


def _snapshot_reads(shard, rounds_write, block: int = 8) -> tuple[list[int], list[int], int]:
    """Items the snapshot holds and those it reads back, 8 at a time, while ``rounds_write``
    overwrites the shard between reads; also the bytes the guard copied."""
    held = list(range(shard.oldest, shard.written))
    snap = ShardSnapshot(shard, block=block)
    out = torch.zeros(8, RB, dtype=torch.uint8)
    read: list[int] = []
    pairs_seen = False
    while snap.read_upto < snap.count:
        rows = snap.read(8, out)
        read += (rows.view(torch.int64)[:, 0] // 1000).tolist()
        assert torch.equal(rows, _records(read[-rows.shape[0] :]))  # every byte, not just ids
        rounds_write(len(read))
        # (copy, event) pairs; host tiers: no event. dict() copies at once (in C): the demoter
        # may add a copy meanwhile
        for rows_copy, event in dict(snap.copies).values():
            assert event is None and rows_copy.device.type == "cpu"
            pairs_seen = True
    assert pairs_seen, "the writes never reached a block the snapshot still had to read"
    copied = snap.copied_bytes
    snap.close()
    assert all(t.guard is None for t in shard.tiers)
    return held, read, copied


def test_a_snapshot_reads_what_a_ring_held_while_appends_overwrite_it():
    shard = Shard(MemoryTier(64, RB))
    shard.append(_records(range(64)))
    nxt = iter(range(64, 10_000))

    def rounds(_read: int) -> None:  # 16 new items per read of 8: the ring overtakes the reader
        shard.append(_records([next(nxt) for _ in range(16)]))

    held, read, copied = _snapshot_reads(shard, rounds)
    assert read == held and copied > 0
    shard.close()


def test_a_snapshot_reads_what_tiers_held_while_the_demoter_rewrites_them():
    shard = TieredShard([MemoryTier(16, RB), MemoryTier(48, RB)], background=True)
    shard.append(_records(range(64)))
    nxt = iter(range(64, 10_000))
    threads = set()

    def rounds(_read: int) -> None:  # a round's 12 items, then the demoter makes room for 12
        shard.append(_records([next(nxt) for _ in range(12)]))
        shard.demote_ahead(12)
        threads.update(t.name for t in threading.enumerate() if t.name.startswith("conduit-"))

    held, read, copied = _snapshot_reads(shard, rounds)
    assert read == held and copied > 0
    assert any(name.startswith("conduit-demote") for name in threads)
    shard.close()


def test_a_shard_has_one_resolved_cuda_device_or_none():
    cpu = torch.device("cpu")
    assert cuda_device([cpu, cpu]) is None
    dev = cuda_device([torch.device("cuda:1"), cpu, torch.device("cuda", 1)])
    assert dev == torch.device("cuda:1")
    with pytest.raises(cd.ConfigError, match=r"one resolved cuda:<index>, got \['cuda:0', 'cu"):
        cuda_device([torch.device("cuda:0"), torch.device("cuda:1")])
    with pytest.raises(cd.ConfigError, match=r"got \['cuda'\]"):
        cuda_device([torch.device("cuda")])  # never "the current device"
    idx = torch.arange(4)
    assert upload(idx, cpu) is idx  # host tiers: host indices as they are
    host = WorkerStream(None)  # no CUDA tier: the demoter's ordering does nothing
    assert host.stream is None and host.device is None
    with host.use():
        host.hand_over()
        host.finished()
    host.join()
    assert host.event is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal on a machine without CUDA")
def test_device_and_pinned_tiers_without_cuda_are_refused_before_anything_is_built(tmp_path):
    def demoters() -> int:
        return sum(t.name.startswith("conduit-demote") for t in threading.enumerate())

    before = demoters()
    cpu = torch.device("cpu")
    with pytest.raises(
        cd.ConfigError, match=r"a 'device' tier expects CUDA device memory, found no CUDA here"
    ):
        cd.Tiers([("device", 8), ("host", 8)]).build(16, RB, cpu)
    with pytest.raises(cd.ConfigError, match=r"a 'pinned' tier expects CUDA .*found no CUDA"):
        cd.Tiers([("disk", 8), ("pinned", 8)], disk_dir=str(tmp_path)).build(16, RB, cpu)
    with pytest.raises(cd.ConfigError, match=r"'device' tier .*found no CUDA"):
        cd.Tiers().build(16, RB, torch.device("cuda"))  # a CUDA plane's default tier
    assert not os.listdir(tmp_path)  # the disk tier listed first was never created
    assert demoters() == before
