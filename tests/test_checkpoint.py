"""Checkpoints on real gloo ranks: written while rounds overwrite the ring, restored onto the same
and other world sizes and tier layouts with the same items, priorities, versions and episodes;
torn checkpoints skipped; failures raised, never silent."""

from __future__ import annotations

import hashlib
import os
import shutil
import threading

import numpy as np
import pytest
import torch
from dist_utils import bench_line, child_env, run_ranks
from plane_helpers import assert_intact, make_batch, spec

import conduit_dist as cd
from conduit_dist.checkpoint import files, writer
from conduit_dist.errors import CheckpointError
from conduit_dist.sampling import KeepsItemState, RoutesFeedback

CAP = 40


def _plane(sampler="prioritized", storage=None, cap=CAP, **kw) -> cd.DataPlane:
    if sampler == "prioritized":
        sampler = cd.Prioritized(alpha=1.0, beta=0.4)
    return cd.DataPlane(
        spec(), cap, seed=3, placement="local", schedule="sync", sampler=sampler,
        storage=storage, **kw,
    )  # fmt: skip


def _live(plane) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """This shard's live items oldest first: their records' bytes (fields only), fields and
    the sampler's per-item state (mass; empty for samplers without any)."""
    sh = plane.shard
    gens = torch.arange(sh.oldest, sh.written)
    out = torch.empty((gens.numel(), sh.tiers[0].record_bytes), dtype=torch.uint8)
    sh.gather(gens, out)
    cols = plane._p.engine.spec.unpack(out)
    keeps = isinstance(plane.sampler, KeepsItemState)
    mass = plane.sampler.item_state(gens)["mass"] if keeps else torch.zeros(0)
    return out[:, : plane.spec.record_bytes].clone(), {k: v.clone() for k, v in cols.items()}, mass


def _fill(plane, rank: int, rounds: int, first: int = 0) -> None:
    """Rounds of puts, fetches and priority updates (priorities vary by id)."""
    for it in range(first, first + rounds):
        plane.put(make_batch(torch.arange(16) + 1000 * rank + 16 * it), version=it)
        b = plane.fetch(8)
        assert_intact(b)
        if isinstance(plane.sampler, RoutesFeedback):
            plane.update_priorities(b["_index"], (b["id"] % 5).double() + 0.5)


def _save(rank, world, root, sampler):
    plane = _plane(sampler)
    _fill(plane, rank, 6)
    plane.flush()
    rows, cols, mass = _live(plane)
    # The writer reads a chunk (here one item), then keeps its rate: held there until the rounds
    # below have overwritten the ring, it must read the rest from their copy-on-write copies
    # (left to a slow rate limit, whether a round came first was a thread race).
    gate, rates = threading.Event(), set()
    writer.CHUNK_BYTES = plane.shard.tiers[0].record_bytes
    writer._keep_rate = lambda done, mbps, t0: (rates.add(mbps), gate.wait(60))
    ck = plane.checkpoint(root, write_mbps=0.05, checksum_mbps=0.5)
    _fill(plane, rank, 4, first=6)  # 64 items over a 40-item ring: every slot rewritten
    gate.set()
    ck.wait(60)
    assert rates == {0.05, 0.5}  # the writer's and the checksum pass's limits
    copied = ck.copied_bytes
    plane.close()
    return rows.numpy(), cols["id"].tolist(), cols["_version"].tolist(), mass.tolist(), copied


def _restore(rank, world, root, sampler, storage, cap, draws):
    plane = _plane(sampler, storage, cap)
    plane.restore(root)
    rows, cols, mass = _live(plane)
    seen = []
    for _ in range(draws):
        b = plane.fetch(64)
        assert_intact(b)
        seen.append(b["id"].clone())
    dropped = plane.store_stats()["restore_dropped"]
    plane.close()
    seen = torch.cat(seen).numpy() if seen else None
    return (
        rows.numpy(),
        cols["id"].tolist(),
        cols["_version"].tolist(),
        mass.tolist(),
        seen,
        dropped,
    )


def _digest(rows: list[torch.Tensor]) -> str:
    """Hash of the sorted item bytes over all shards."""
    allrows = np.concatenate(rows)
    order = np.lexsort(allrows.T[::-1])
    return hashlib.sha256(allrows[order].tobytes()).hexdigest()


@pytest.mark.parametrize(
    ("old", "new", "storage", "cap"),
    [(2, 3, None, CAP), (3, 2, None, 60), (3, 2, None, CAP), (2, 2, ("host", 16, "disk", 16), 32)],
)
def test_restore_same_items_and_priorities_on_another_world_or_layout(
    tmp_path, old, new, storage, cap
):
    from scipy.stats import chisquare

    root = str(tmp_path / "ck")
    saved = run_ranks(_save, old, root, "prioritized", timeout_s=120)
    assert all(r[4] > 0 for r in saved.values())  # the rounds did overwrite ahead of the writer
    tiers = None
    if storage is not None:
        tiers = cd.Tiers(
            [(storage[0], storage[1]), (storage[2], storage[3])],
            disk_dir=str(tmp_path / "disk"),
            gbps={"host": (1, 1), "disk": (1, 1)},
        )
    cap_new = cap  # 3 -> 2 at CAP and the smaller tiers: more items than fit (dropped, counted)
    back = run_ranks(_restore, new, root, "prioritized", tiers, cap_new, 40, timeout_s=180)
    before = [saved[r] for r in range(old)]
    after = [back[r] for r in range(new)]
    n_before = sum(len(r[1]) for r in before)
    n_after = sum(len(r[1]) for r in after)
    dropped = sum(r[5] for r in after)
    assert n_before == n_after + dropped
    if new * cap_new >= n_before:  # everything fits: the very same items, bytes and all
        assert dropped == 0
        assert _digest([r[0] for r in before]) == _digest([r[0] for r in after])
    # every restored item with its version and priority (mass) as before
    mass_of = {i: (m, v) for r in before for i, v, m in zip(r[1], r[2], r[3])}
    for r in after:
        for i, v, m in zip(r[1], r[2], r[3]):
            assert mass_of[i] == (m, v)
    # prioritized sampling after the restore follows the saved masses (chi-square, every learner)
    ids = [i for r in after for i in r[1]]
    p = np.array([mass_of[i][0] for i in ids])
    p = p / p.sum()
    for r in after:
        counts = np.array([(r[4] == i).sum() for i in ids])
        assert chisquare(counts, p * counts.sum()).pvalue > 1e-3
    # and a deliberately wrong distribution (uniform) fails the same test
    counts = np.array([(after[0][4] == i).sum() for i in ids])
    assert chisquare(counts, np.full(len(ids), counts.sum() / len(ids))).pvalue < 1e-6


def _same_world(rank, world, root, phase):
    plane = _plane()
    if phase == "save":
        _fill(plane, rank, 5)
        plane.flush()
        b = plane.fetch(8)  # addresses fetched before the checkpoint...
        plane.checkpoint(root).wait(60)
        plane.close()
        return b["_index"].tolist(), b["id"].tolist()
    plane.restore(root)
    index, ids = torch.tensor(phase[0]), phase[1]
    plane.update_priorities(index, torch.full((index.numel(),), 50.0))  # ...still valid after
    plane.flush()
    _, cols, mass = _live(plane)
    st = plane.store_stats()
    plane.close()
    m = dict(zip(cols["id"].tolist(), mass.tolist()))
    return [m[i] for i in ids if i in m], st["priority_updates_dropped"]


def test_same_world_restore_keeps_addresses(tmp_path):
    root = str(tmp_path / "ck")
    saved = run_ranks(_same_world, 2, root, "save")
    back = run_ranks(_same_world, 2, root, (saved[0][0], saved[0][1]))
    got = back[0][0] + back[1][0]
    assert got and all(abs(m - 50.0) < 1e-4 for m in got)
    assert back[0][1] == 0 and back[1][1] == 0


FIELDS = {"id": ((), torch.int64), "env": ((), torch.int64), "done": ((), torch.bool)}


def _episodes(rank, world, root, phase):
    seq = cd.Windows(length=3, stream="env")
    plane = cd.DataPlane(
        cd.ExperienceSpec(FIELDS), 60 if phase == "save" else 110, seed=5, placement="local",
        schedule="sync",
        sampler=cd.Prioritized(alpha=0.0, beta=0.0, eps=0.0, sequence=seq),
    )  # fmt: skip
    if phase == "save":
        for t in range(25):
            ids = torch.tensor([rank * 10_000 + e * 1000 + t for e in range(2)])
            plane.put({"id": ids, "env": torch.arange(2), "done": (ids % 7 == 0)})
            plane.flush()
    else:
        plane.restore(root)
    sh = plane.shard
    gens = torch.arange(sh.oldest, sh.written)
    starts = sh.written - sh.size + (plane.sampler.item_state(gens)["mass"] > 0).nonzero()
    rows = torch.empty((starts.numel(), sh.tiers[0].record_bytes), dtype=torch.uint8)
    sh.gather(starts.squeeze(1), rows)
    first = plane._p.engine.spec.unpack(rows)["id"].tolist()
    windows = {}
    if first:
        b = plane.fetch(200, oversample=True)
        windows = {row[0]: row for row in b["id"].tolist()}
    if phase == "save":
        plane.checkpoint(root).wait(60)
    plane.close()
    return sorted(first), windows


def test_episode_structure_survives_three_to_two(tmp_path):
    root = str(tmp_path / "ck")
    before = run_ranks(_episodes, 3, root, "save")
    after = run_ranks(_episodes, 2, root, "load")
    starts_before = sorted(s for r in before.values() for s in r[0])
    starts_after = sorted(s for r in after.values() for s in r[0])
    assert starts_before == starts_after  # every window start, no new one across shards
    windows = {k: v for r in before.values() for k, v in r[1].items()}
    for r in after.values():
        for start, row in r[1].items():
            assert row == windows.get(start, row)  # the same window from each start


def _torn(rank, world, root):
    plane = _plane("uniform")
    _fill(plane, rank, 3)
    plane.flush()
    plane.checkpoint(root).wait(60)
    _fill(plane, rank, 2, first=3)
    plane.flush()
    plane.checkpoint(root).wait(60)
    plane.close()


def _load_ids(rank, world, root):
    plane = _plane("uniform")
    plane.restore(root)
    out = plane.round, sorted(_live(plane)[1]["id"].tolist())
    plane.close()
    return out


def test_torn_or_unfinished_checkpoint_is_skipped(tmp_path):
    root = str(tmp_path / "ck")
    run_ranks(_torn, 2, root)
    old, new = files.complete(root)[1], files.complete(root)[0]
    os.makedirs(files.directory(root, 99, token=7))  # a write killed midway: ignored
    with open(os.path.join(new, "shard1.items"), "r+b") as f:  # a torn newer checkpoint
        f.truncate(100)
    back = run_ranks(_load_ids, 2, root)
    assert back[0][0] == files.read_manifest(old)["round"]
    # the newer (torn) one is set aside: it no longer outranks what this timeline writes next
    assert files.complete(root) == [old]
    new = os.path.join(root, "set_aside", os.path.basename(new))
    with pytest.raises(CheckpointError, match="shard1.items"):
        files.verify(new, files.read_manifest(new), [1])
    shutil.rmtree(old)
    res = run_ranks(_load_ids, 2, root, allow_failure=True)
    assert all(r[0] == "error" and "no complete checkpoint" in r[1] for r in res.values())


def _wrong_sampler(rank, world, root):
    plane = _plane("uniform")
    _fill(plane, rank, 2)
    plane.flush()
    plane.checkpoint(root).wait(60)
    plane.close()
    other = _plane()  # prioritized: another record layout and sampler
    _fill(other, rank, 1)
    other.flush()
    before = (len(other), other.shard.size)
    with pytest.raises(cd.ConfigError, match="restore: checkpoint records"):
        other.restore(root)
    after = (len(other), other.shard.size)
    other.close()
    return before == after


def test_restore_refuses_another_sampler_before_touching_the_shard(tmp_path):
    assert run_ranks(_wrong_sampler, 2, str(tmp_path / "ck")) == {0: True, 1: True}


def _disagree(rank, world, root):
    plane = _plane("uniform")
    _fill(plane, rank, 2)
    if rank == 0:
        plane.put(make_batch(torch.arange(3)))  # staged on one rank only
    try:
        plane.checkpoint(root)
        return "no error"
    except CheckpointError as e:
        return str(e)
    finally:
        plane.close()


def test_checkpoint_with_staged_items_names_the_rank(tmp_path):
    res = run_ranks(_disagree, 2, str(tmp_path / "ck"))
    for text in res.values():
        assert "staged since round" in text and "ranks [0]" in text


def _vanish(path: str) -> None:
    """Remove a directory the writer thread may be adding a file to meanwhile (an rmtree
    racing it finds the directory not empty: retry until it is gone)."""
    while os.path.exists(path):
        shutil.rmtree(path, ignore_errors=True)


def _write_fails(rank, world, root):
    plane = _plane("uniform", cap=40)
    _fill(plane, rank, 3)
    plane.flush()
    with pytest.raises(cd.ConfigError, match=r"extra\['model'\]\['f'\]"):
        plane.checkpoint(root, extra={"model": {"f": print}})
    ck = plane.checkpoint(root, checksum_mbps=0.002)  # its checksum pass: ~1 s for ~2 KB
    _vanish(ck.tmp)  # the directory vanishes under the writer
    ck._thread.join(30)
    with pytest.raises(CheckpointError, match="failed to write"):
        plane.flush()  # the background failure, at the next call
    plane.flush()  # raised once; the plane goes on
    ck2 = plane.checkpoint(root, checksum_mbps=0.002)
    _vanish(ck2.tmp)
    with pytest.raises(CheckpointError, match="failed to write"):
        plane.close()  # waits for the writer, releases the plane, then raises
    assert plane._closed
    return ck.complete


def test_background_write_failure_surfaces_at_the_next_call(tmp_path):
    assert run_ranks(_write_fails, 1, str(tmp_path / "ck")) == {0: False}


def test_checkpoint_bench_runs_every_mode(tmp_path):
    """``bench checkpoint`` at a toy size on 2 ranks: every mode measured, ratios last."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "conduit_dist.bench", "checkpoint", "--gib", "0.004", "--repeats", "1",
         "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=240, env=child_env(),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    res = bench_line(out.stdout)
    modes = {r["mode"]: r for r in res["results"]}
    assert set(modes) == {"ours", "ours_checksum_limited", "dcp_async", "stop_world"}
    assert all(f"{m}_cost" in res["summary"] for m in modes)
    assert modes["ours"]["write_s"] > 0 and modes["stop_world"]["blocked_s"] > 0


def test_a_state_of_another_sampler_or_variant_is_refused_before_anything_changes():
    """alpha = 0 and alpha > 0 are different Prioritized variants (one routes updates), and a
    uniform plane's state is not a stratified one's: refused, the store left as it was."""
    saved = {}
    for name, sampler in (("flat", cd.Prioritized(alpha=0.0)), ("uniform", "uniform")):
        plane = cd.DataPlane(spec(), 16, seed=1, sampler=sampler, placement="local")
        plane.put(make_batch(torch.arange(8)))
        plane.flush()
        saved[name] = plane.state_dict()
        plane.close()
    for name, sampler, match in (
        ("flat", cd.Prioritized(alpha=0.6), "plane has a RoutedPrioritized"),
        ("uniform", "stratified", "the plane has 'stratified'"),
    ):
        plane = cd.DataPlane(spec(), 16, seed=1, sampler=sampler, placement="local")
        plane.put(make_batch(torch.arange(100, 104)))
        plane.flush()
        with pytest.raises(cd.ConfigError, match=match):
            plane.load_state_dict(saved[name])
        assert len(plane) == 4 and sorted(
            plane.fetch(64, oversample=True)["id"].unique().tolist()
        ) == list(range(100, 104))
        plane.close()


def _weights_after_load(rank, world):
    net = torch.nn.Linear(2, 2)
    plane = cd.DataPlane(spec(), 16, seed=1, schedule="sync", learner_ranks=[0])
    if rank == 0:
        plane.publish_weights(net)
    plane.flush()  # version 1 broadcast
    if rank == 0:
        plane.publish_weights(net)  # version 2: not broadcast before the state is taken
    saved = plane.state_dict()
    plane.close()
    fresh = cd.DataPlane(spec(), 16, seed=1, schedule="sync", learner_ranks=[0])
    fresh.load_state_dict(saved)
    fresh.flush()  # the restored learner holds no buffer for version 2: nothing to broadcast
    if rank == 0:
        fresh.publish_weights(net)  # version 3, broadcast in the next round
    fresh.flush()
    got = fresh.pull_weights(torch.nn.Linear(2, 2)) if rank else fresh.policy_version
    fresh.close()
    return got


def test_rounds_after_a_load_broadcast_only_weights_that_exist():
    assert run_ranks(_weights_after_load, 2) == {0: 3, 1: 3}
