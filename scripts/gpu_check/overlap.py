"""Step (o) of the GPU check: overlap timed against sync with a GPU-bound backward, and the
overlapped plane's memory over 300 rounds; 2 ranks sharing one GPU (gloo carries CUDA tensors).

Each rank trains a tower of ``width x width`` layers whose depth is set once (on rank 0, alone
on the GPU, then shared) so that one backward takes :data:`TARGET_MS` of GPU time. An iteration
is the loop a learner runs: put its actors' items, ``fetch``, forward, backward, and one host
read (the logged loss: the host waits there for the backward's GPU work, as a loop that logs its
loss does). The plane's rounds are attached to the tower (``plane.attach``). :data:`ITERS`
iterations in ``sync`` (the round runs inside ``fetch``), then as many in ``overlap`` (the round
is launched when the backward starts and runs on the round thread while the GPU works): the
exposed wait of each fetch is its wall time (and ``plane.last_fetch.exposed_ms``), the hidden
part ``plane.last_fetch.hidden_ms``. Checked: overlap's median exposed wait at most
:data:`EXPOSED_RATIO` of sync's, and the round at least :data:`HIDDEN_SHARE` hidden
(``hidden / (hidden + exposed)`` over the overlapped fetches). Both planes draw ``stratified``
(each shard gives each learner its share: every round moves the same sizes), so the overlapped
plane then runs on with a one-layer tower until round :data:`ROUNDS` [1], and the CUDA
allocator's counts after round ``ROUNDS[0]`` and after ``ROUNDS[1]`` must agree within
``common.ALLOCATED_SLACK`` / ``RESERVED_SLACK``.

    CONDUIT_CUDA_BACKEND=gloo torchrun --standalone --nproc_per_node=2 scripts/gpu_check/overlap.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from common import DEVICE, DRY, check, items, memory, memory_flat, ok

import conduit_dist as cd
from conduit_dist.collectives.dist import resolve_device

TARGET_MS = 3.0 if DRY else 30.0  # GPU time of one backward (the issue: 20-40 ms)
WIDTH, BATCH = (64, 64) if DRY else (4096, 1024)
MAX_DEPTH = 64
ITERS, WARM = (8, 2) if DRY else (30, 6)  # iterations per schedule after WARM untimed ones
ROUNDS = (10, 30) if DRY else (50, 300)  # memory compared after these rounds of overlap
EXPOSED_RATIO = 0.25  # overlap's median exposed wait / sync's, at most
HIDDEN_SHARE = 0.70  # hidden / (hidden + exposed) of the overlapped rounds, at least


class Tower(torch.nn.Module):
    """``depth`` tanh layers of ``width`` over the batch's observations; :attr:`use` of them run
    (the depth is tuned after construction)."""

    def __init__(self, inp: int, width: int, depth: int, device: torch.device) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(inp, width, device=device)
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(width, width, device=device) for _ in range(depth)
        )
        self.out = torch.nn.Linear(width, 1, device=device)
        self.use = depth

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = self.inp(obs.flatten(1).float() / 255)
        for layer in self.layers[: self.use]:
            x = torch.tanh(layer(x))
        return self.out(x)


def _backward_ms(model: Tower, obs: torch.Tensor) -> float:
    """GPU milliseconds of one backward (CUDA events on the current stream; wall time in a dry
    run), the median of 3 after one untimed."""
    times = []
    for _ in range(4):
        loss = model(obs).square().mean()
        if DRY:
            t0 = time.perf_counter()
            loss.backward()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss.backward()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:])


def tune(model: Tower, obs: torch.Tensor, rank: int) -> tuple[int, float]:
    """Set ``model.use`` on every rank to the depth whose backward takes :data:`TARGET_MS`,
    timed on rank 0 while the other rank waits (so the GPU is not shared while timing); returns
    ``(depth, measured ms)``."""
    got = [0, 0.0]
    if rank == 0:
        model.use = 4
        per_layer = _backward_ms(model, obs) / 4
        model.use = max(1, min(MAX_DEPTH, round(TARGET_MS / max(per_layer, 1e-3))))
        got = [model.use, _backward_ms(model, obs)]
    dist.broadcast_object_list(got, src=0)
    model.use = got[0]
    model.zero_grad(set_to_none=True)
    return got[0], got[1]


def iteration(plane: cd.DataPlane, model: Tower, rank: int, it: int) -> tuple[float, object]:
    """One learner iteration; returns the fetch's wall milliseconds and its ``last_fetch``."""
    plane.put(items(torch.arange(BATCH) + BATCH * it + 1_000_000_000 * rank))
    t0 = time.perf_counter()
    b = plane.fetch(BATCH)
    wall = (time.perf_counter() - t0) * 1e3
    timing = plane.last_fetch
    loss = model(b["obs"]).square().mean()
    loss.backward()
    loss.item()  # the loop's one host read: here the host waits for the backward's GPU time
    return wall, timing


def timed(schedule: str, spec: cd.ExperienceSpec, model: Tower, rank: int):
    """:data:`ITERS` timed iterations in ``schedule``; returns the plane (still open) and the
    exposed (wall and plane's) and hidden milliseconds of each timed fetch."""
    plane = cd.DataPlane(spec, 8192, seed=41, device=DEVICE, schedule=schedule,
                         sampler="stratified")  # fmt: skip
    plane.attach(model)
    check(DRY or plane.chosen_schedule == schedule, f"{schedule}: ran {plane.chosen_schedule}")
    wall, exposed, hidden = [], [], []
    for it in range(WARM + ITERS):
        w, timing = iteration(plane, model, rank, it)
        if it >= WARM:
            wall.append(w)
            exposed.append(timing.exposed_ms)
            hidden.append(timing.hidden_ms)
    return plane, {"wall": wall, "exposed": exposed, "hidden": hidden}


def summarise(sync: dict, over: dict) -> dict[str, float]:
    """The medians, overlap's share of sync's exposed wait and the hidden share."""
    s_med, o_med = statistics.median(sync["wall"]), statistics.median(over["wall"])
    hid, exp = sum(over["hidden"]), sum(over["exposed"])
    return {
        "sync_exposed_ms": s_med,
        "overlap_exposed_ms": o_med,
        "ratio": o_med / max(s_med, 1e-9),
        "hidden_share": hid / max(hid + exp, 1e-9),
        "overlap_plane_exposed_ms": statistics.median(over["exposed"]),
        "overlap_plane_hidden_ms": statistics.median(over["hidden"]),
    }


def memory_over_rounds(plane: cd.DataPlane, model: Tower, rank: int) -> dict[str, int]:
    """The overlapped plane on to round ``ROUNDS[1]`` with a one-layer tower; the allocator's
    counts after ``ROUNDS[0]`` and ``ROUNDS[1]`` (the launched round finished: ``wait()``)."""
    model.use = 1
    marks = {}
    for it in range(1, ROUNDS[1] + 1):
        iteration(plane, model, rank, WARM + ITERS + it)
        if it in ROUNDS:
            plane.wait()  # every rank at the same point: the round launched at backward is done
            marks[it] = memory(plane.device)
    if DRY:
        return {"rounds": ROUNDS[1]}
    return memory_flat(marks[ROUNDS[0]], marks[ROUNDS[1]], f"rank {rank}, overlapped plane")


def main() -> None:
    """Run step (o)."""
    check(DRY or torch.cuda.is_available(), "no CUDA device visible")
    cd.init_distributed(device=DEVICE)
    try:
        rank = dist.get_rank()
        check(dist.get_world_size() == 2, f"expected 2 ranks, got {dist.get_world_size()}")
        spec = cd.ExperienceSpec.from_batch(items(torch.arange(1)))
        dev = resolve_device(DEVICE)  # once, as every plane of this rank resolves it
        model = Tower(spec.fields["obs"].numel, WIDTH, MAX_DEPTH, dev)
        obs = items(torch.arange(BATCH), dev)["obs"]
        depth, ms = tune(model, obs, rank)
        sync_plane, sync = timed("sync", spec, model, rank)
        sync_plane.close()
        plane, over = timed("overlap", spec, model, rank)
        got = summarise(sync, over)
        mem = memory_over_rounds(plane, model, rank)
        plane.close()
        parts: list[object] = [None] * 2
        dist.all_gather_object(parts, {**got, **mem})
        for r, p in enumerate(parts):
            if not DRY:  # the CPU's cores run the learner and the round alike: no claim there
                check(p["ratio"] <= EXPOSED_RATIO, f"rank {r}: overlap exposed {p['ratio']:.0%} "
                      f"of sync's ({p['overlap_exposed_ms']:.2f} vs {p['sync_exposed_ms']:.2f} "
                      f"ms), expected <= {EXPOSED_RATIO:.0%}")  # fmt: skip
                check(p["hidden_share"] >= HIDDEN_SHARE, f"rank {r}: round {p['hidden_share']:.0%}"
                      f" hidden, expected >= {HIDDEN_SHARE:.0%}")  # fmt: skip
        p0 = parts[0]
        ok(
            "o.overlap",
            f"backward {ms:.1f} ms of {'CPU' if DRY else 'GPU'} time ({depth} layers of {WIDTH}); "
            f"median exposed wait "
            f"per fetch: sync {p0['sync_exposed_ms']:.2f} ms, overlap "
            f"{p0['overlap_exposed_ms']:.2f} ms ({p0['ratio']:.1%} of sync's, at most "
            f"{EXPOSED_RATIO:.0%}); round {p0['hidden_share']:.1%} hidden (at least "
            f"{HIDDEN_SHARE:.0%}); rank 1: {parts[1]['ratio']:.1%}, {parts[1]['hidden_share']:.1%}",
            backward_ms=ms,
            depth=depth,
            **{k: v for k, v in p0.items() if not k.startswith(("allocated", "reserved"))},
        )
        if not DRY:
            ok(
                "o.memory",
                f"overlapped 2-rank plane: allocated {p0['allocated_early']} -> "
                f"{p0['allocated_late']} B, reserved {p0['reserved_early']} -> "
                f"{p0['reserved_late']} B between rounds {ROUNDS[0]} and {ROUNDS[1]} (rank 1: "
                f"+{parts[1]['allocated_grew']} B, +{parts[1]['reserved_grew']} B)",
                **{k: v for k, v in p0.items() if k.startswith(("allocated", "reserved"))},
            )
        else:
            ok("o.memory", f"overlapped 2-rank plane ran {ROUNDS[1]} rounds (no CUDA memory)")
    finally:
        cd.destroy_distributed()


if __name__ == "__main__":
    main()
