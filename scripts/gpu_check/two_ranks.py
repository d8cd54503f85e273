"""Step (b) of the GPU check: 2 ranks sharing one GPU, CUDA tensors carried by gloo.

NCCL refuses two ranks on one GPU, so the CUDA backend is gloo (``cuda_backend="gloo"``; the
shell script also sets ``CONDUIT_CUDA_BACKEND=gloo``): gloo carries the rounds' all-to-all,
gather and broadcast of CUDA tensors. Checked: overlap delivers sync's batches; device / pinned /
host tiers past overflow with puts from the host, from GPU tensors (staged and donated) and from
a second thread, every row checked; prioritized items, slices and n-step windows delivered on
the GPU; a checkpoint of a device-tier plane written while rounds overwrite it, restored with
the same items (SHA-256).

    CONDUIT_CUDA_BACKEND=gloo torchrun --standalone --nproc_per_node=2 \\
        scripts/gpu_check/two_ranks.py
"""

from __future__ import annotations

import math
import os
import tempfile

import torch
import torch.distributed as dist
from common import (
    DEVICE,
    DRY,
    check,
    digest,
    items,
    live_rows,
    ok,
    put_in_thread,
    stream_ids,
    tier,
    verify,
)

import conduit_dist as cd
from conduit_dist.checkpoint import writer
from conduit_dist.errors import ConfigError, EmptyStoreError

GAMMA = 0.9


def _fetches(spec: cd.ExperienceSpec, rank: int, schedule: str, placement: str):
    """12 fetches of 128 (the same puts for either schedule); the ids delivered and the plane's
    round schedule."""
    model = torch.nn.Linear(spec.fields["obs"].numel, 1).to(DEVICE)
    plane = cd.DataPlane(spec, 4096, seed=1, device=DEVICE, schedule=schedule, placement=placement)
    plane.attach(model)
    check(plane.chosen_schedule == schedule, f"{schedule}: ran {plane.chosen_schedule}")
    ids = []
    for it in range(12):
        batch = items(torch.arange(256) + 1000 * it + 1_000_000 * rank)
        if schedule == "overlap" or it == 0:  # a launched round misses later puts
            plane.put(batch)
        b = plane.fetch(128)
        verify(b, plane.device)
        ids.append(b["id"].to("cpu", copy=True))  # a copy: the batch is a pooled view
        model(b["obs"].flatten(1).float()).sum().backward()
        if schedule == "sync" and it > 0:
            plane.put(batch)
    rounds = plane.schedule
    plane.close()
    return ids, rounds


def sync_vs_overlap(spec: cd.ExperienceSpec, rank: int) -> None:
    """The same puts give the same batches whether rounds run in fetch or behind backward,
    where both run the same round schedule; where they do not (CUDA, ``local``: sync's rows stay
    on the GPU, ``general``; overlapped rounds compose on the host, ``fused``), each is its own
    uniform stream, and every delivered item was put before its round."""
    notes = []
    for placement in ("round_robin", "local"):
        got = {s: _fetches(spec, rank, s, placement) for s in ("sync", "overlap")}
        (s_ids, s_rounds), (o_ids, o_rounds) = got["sync"], got["overlap"]
        if s_rounds == o_rounds:
            same = all(torch.equal(a, b) for a, b in zip(s_ids, o_ids))
            check(same, f"rank {rank}, {placement}: overlap differs from sync ({s_rounds})")
            notes.append(f"{placement}: equal ({s_rounds} rounds)")
            continue
        for mode, (ids, _) in got.items():
            for it, b in enumerate(ids):
                last = max(it - 1, 0)  # the last put its round took (launched at the backward)
                step = b % 1_000_000 // 1000  # the put iteration of each item
                check(bool((step <= last).all()), f"{mode}, fetch {it}: an item put after it")
                # and its round took the last put in: 128 draws miss a 1/it share < 1e-5
                check(int(step.max()) == last, f"{mode}, fetch {it}: nothing from put {last}")
        notes.append(f"{placement}: sync {s_rounds} / overlap {o_rounds} rounds, each valid")
    ok("b.overlap", f"2 ranks, 12 fetches each: {'; '.join(notes)}")


def tiers_donated_thread(spec: cd.ExperienceSpec, rank: int, step: str = "b.tiers") -> None:
    """Device, pinned and host tiers past overflow; host, GPU, donated and threaded puts (also
    run under the CUDA sanitizer, ``sanitizer.py``, as ``step``)."""
    storage = cd.Tiers([(tier("device"), 256), (tier("pinned"), 256), ("host", 512)])
    plane = cd.DataPlane(
        spec, 1024, seed=3, device=DEVICE, schedule="overlap", placement="round_robin",
        storage=storage,
    )  # fmt: skip
    dev = plane.device
    model = torch.nn.Linear(spec.fields["obs"].numel, 1).to(DEVICE)
    plane.attach(model)
    rows, seen, donated = 0, set(), []
    for it in range(12):  # 512 items per rank a round over 1024 slots: every tier overflows
        base = 1_000_000 * rank + 1000 * it
        plane.put(items(torch.arange(base, base + 128)))
        plane.put(items(torch.arange(base + 200, base + 328), dev))
        donated.append(items(torch.arange(base + 400, base + 528), dev))
        plane.put(donated[-1], donate=True)
        put_in_thread(plane, items(torch.arange(base + 600, base + 728), dev))
        b = plane.fetch(256)
        rows += verify(b, dev)
        seen.update((b["id"] % 1000 // 200).unique().tolist())
        model(b["obs"].flatten(1).float()).sum().backward()
        del donated[:-2]  # a donated batch is left alone until its round completed
    plane.wait()
    stats = plane.store_stats()
    kinds = [t["kind"] for t in stats["tiers"]]  # (demotion ahead may leave the first empty)
    check(kinds == [tier("device"), tier("pinned"), "host"], f"rank {rank}: tiers {kinds}")
    check(stats["demotions"] > 0 and stats["evictions"] > 0, f"rank {rank}: no overflow {stats}")
    check(seen >= {0, 1, 2, 3}, f"rank {rank}: delivered kinds of put {sorted(seen)}")
    plane.close()
    ok(
        step,
        f"device/pinned/host tiers past overflow; host, GPU, donated and second-thread puts "
        f"all delivered; {rows} rows checked on rank 0",
    )


def _stream_batch(rank: int, t: int, envs: int = 8) -> dict[str, torch.Tensor]:
    ids = torch.stack([stream_ids(rank, e, torch.tensor(t)) for e in range(envs)])
    return items(ids)


def prioritized(spec: cd.ExperienceSpec, rank: int) -> None:
    """Prioritized items on the GPU, priorities sent back from GPU tensors."""
    plane = cd.DataPlane(
        spec, 2048, seed=5, device=DEVICE, schedule="sync", placement="round_robin",
        sampler=cd.Prioritized(alpha=0.6, beta=0.4),
    )  # fmt: skip
    dev = plane.device
    for it in range(10):
        plane.put(items(torch.arange(256) + 1000 * it + 1_000_000 * rank))
        b = plane.fetch(128)
        verify(b, dev)
        check(b["_index"].device == dev and b["_weight"].device == dev, "_index/_weight off GPU")
        w = b["_weight"]
        check(bool(((w > 0) & (w <= 1 + 1e-6)).all()), "importance weights outside (0, 1]")
        plane.update_priorities(b["_index"], (b["id"] % 5).float() + 0.5)
    plane.close()
    ok("b.prioritized", "prioritized items and weights on the GPU, priorities from GPU tensors")


def windows(spec: cd.ExperienceSpec, rank: int) -> None:
    """Slices and n-step windows of each env's stream, delivered on the GPU."""
    slices = cd.Prioritized(
        alpha=0.0, beta=0.0, eps=0.0, sequence=cd.Windows(length=4, stream="env")
    )
    seq = cd.Windows(n_step=3, gamma=GAMMA, stream="env", truncated="truncated")
    nstep = cd.Prioritized(alpha=0.0, beta=0.0, eps=0.0, sequence=seq)
    for name, sampler in (("slices", slices), ("n-step", nstep)):
        plane = cd.DataPlane(
            spec, 512, seed=6, device=DEVICE, schedule="sync", placement="round_robin",
            sampler=sampler,
        )  # fmt: skip
        dev = plane.device
        for t in range(40):
            plane.put(_stream_batch(rank, t))
            if t < 8:
                plane.flush()
                continue
            b = plane.fetch(32)
            verify(b, dev)
            ids = b["id"]
            if name == "slices":
                check(ids.shape == (32, 4), f"slices of shape {tuple(ids.shape)}")
                check(bool((ids[:, 1:] - ids[:, :-1] == 1).all()), "a slice is not one stream")
            else:
                _check_nstep(b, dev)
        plane.close()
    ok("b.windows", "slices and n-step windows of each env's stream delivered on the GPU")


def _check_nstep(b: dict[str, torch.Tensor], dev: torch.device) -> None:
    """n-step values against the items' own rewards (no episode ends in these streams)."""
    for key in ("_return", "_discount", "_last_id"):
        check(b[key].device == dev, f"{key} on {b[key].device}")
    for i, last, ret, disc in zip(
        b["id"].tolist(), b["_last_id"].tolist(), b["_return"].tolist(),
        b["_discount"].tolist(),
    ):  # fmt: skip
        m = last - i + 1
        check(1 <= m <= 3, f"window of {m} items from {i}")
        want = sum(GAMMA**k * float(items(torch.tensor([i + k]))["reward"]) for k in range(m))
        check(math.isclose(ret, want, rel_tol=1e-5), f"return {ret} from {i}, expected {want}")
        check(math.isclose(disc, GAMMA**m, rel_tol=1e-6), f"discount {disc} from {i}")


def queues(spec: cd.ExperienceSpec, rank: int) -> None:
    """``Fifo`` and ``Lifo`` drained on the GPU: each item delivered once over both ranks, all
    of them but fewer than a batch (378 items, batches of 8 on 2 learners: 2 left); delivered
    ``stratified`` batches checked row by row; on both placements."""
    notes = []
    for placement in ("local", "round_robin"):
        for name, sampler in (("fifo", cd.Fifo()), ("lifo", cd.Lifo()), ("stratified", None)):
            plane = cd.DataPlane(
                spec, 1024, seed=8, device=DEVICE, schedule="sync", placement=placement,
                sampler=sampler or "stratified",
            )  # fmt: skip
            for it in range(3):
                plane.put(items(torch.arange(63) + 1000 * it + 1_000_000 * rank))
                plane.flush()
            got: list[int] = []
            for _ in range(100):  # plane.stored is the same on every rank: the same rounds
                if sampler is not None and plane.stored < 8:
                    break
                try:
                    b = plane.fetch(8)
                except EmptyStoreError:  # the last items went to the learners before this one
                    continue
                verify(b, plane.device)
                got += b["id"].tolist()
                if sampler is None and len(got) >= 64:
                    break
            left, schedule = plane.stored, plane.schedule
            plane.close()
            parts: list[object] = [None] * dist.get_world_size()
            dist.all_gather_object(parts, got)
            every = [i for p in parts for i in p]
            if sampler is not None:
                check(len(every) == len(set(every)), f"{name}, {placement}: an item twice")
                check(len(every) + left == 378 and left < 8, f"{name}: {len(every)} + {left}")
            notes.append(f"{name} {placement} ({schedule})")
    # gloo has no send/recv or gather of CUDA tensors: forcing either on this plane is refused
    # (auto keeps GPU rows to the fused all-to-all, which the rounds above went through)
    for forced in () if DRY else ("p2p", "gather"):  # a CPU plane takes any strategy
        try:
            cd.DataPlane(spec, 64, device=DEVICE, transport=cd.TransportConfig(strategy=forced))
        except ConfigError as exc:
            check(repr(forced) in str(exc) and "gloo" in str(exc), f"refusal: {exc}")
        else:
            check(False, f"strategy={forced!r} on a CUDA plane over gloo was not refused")
    notes += [] if DRY else ["p2p and gather refused"]
    ok("b.queues", f"drained once each / delivered on the GPU: {', '.join(notes)}")


def checkpoint_while_overwritten(
    spec: cd.ExperienceSpec, rank: int, root: str, step: str = "b.checkpoint"
) -> None:
    """A device-tier plane checkpointed at a round, its ring overwritten twice while the
    writer (rate-limited, small chunks) is still reading; the restore holds the same items
    (also run under the CUDA sanitizer, ``sanitizer.py``, as ``step``)."""

    def build() -> cd.DataPlane:
        return cd.DataPlane(
            spec, 512, seed=7, device=DEVICE, schedule="sync", placement="local",
            storage=cd.Tiers([(tier("device"), 512)]),
        )  # fmt: skip

    plane = build()
    for it in range(6):
        plane.put(items(torch.arange(128) + 1000 * it + 1_000_000 * rank))
        verify(plane.fetch(64), plane.device)
    plane.flush()
    before = live_rows(plane)
    writer.CHUNK_BYTES = 32 * plane.shard.tiers[0].record_bytes  # the writer reads in steps
    ck = plane.checkpoint(root, write_mbps=0.25)  # ~2 s for 512 items of ~1.1 KB
    for it in range(6, 14):  # 1024 items over the 512-item ring while it writes
        plane.put(items(torch.arange(128) + 1000 * it + 1_000_000 * rank))
        verify(plane.fetch(64), plane.device)
    ck.wait(120)
    copied = ck.copied_bytes
    plane.close()
    restored = build()
    restored.restore(root)
    after = live_rows(restored)
    restored.close()
    parts: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (before, after, copied))
    saved, back = digest([p[0] for p in parts]), digest([p[1] for p in parts])
    check(saved == back, f"restored items differ: sha256 {back[:16]} != saved {saved[:16]}")
    check(all(p[2] > 0 for p in parts), f"no copy-on-write copies: {[p[2] for p in parts]}")
    ok(
        step,
        f"device-tier checkpoint written while rounds overwrote it: sha256 {saved[:16]} "
        f"restored equal ({sum(p[2] for p in parts)} bytes copied ahead of the writer)",
        checkpoint_sha256=saved,
    )


def shared_dir() -> str:
    """One directory both ranks see (under ``$GPU_CHECK_OUT`` when set)."""
    path = [tempfile.mkdtemp(prefix="ckpt-", dir=os.environ.get("GPU_CHECK_OUT"))]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def main() -> None:
    """Run step (b)."""
    check(DRY or torch.cuda.is_available(), "no CUDA device visible")
    cd.init_distributed(device=DEVICE, **({} if DRY else {"cuda_backend": "gloo"}))
    try:
        rank = dist.get_rank()
        check(dist.get_world_size() == 2, f"expected 2 ranks, got {dist.get_world_size()}")
        spec = cd.ExperienceSpec.from_batch(items(torch.arange(1)))
        sync_vs_overlap(spec, rank)
        tiers_donated_thread(spec, rank)
        prioritized(spec, rank)
        windows(spec, rank)
        queues(spec, rank)
        checkpoint_while_overwritten(spec, rank, shared_dir())
    finally:
        cd.destroy_distributed()


if __name__ == "__main__":
    main()
