"""What step (s) runs under the CUDA sanitizer (``TORCH_CUDA_SANITIZER=1``: ``torch.cuda.
_sanitizer``, which checks every kernel's reads and writes against the streams and events that
order them, and raises on a possible data race), at 1 rank and at 2 ranks sharing the GPU:

- overlapped rounds: ``schedule="overlap"``, a module attached, rounds launched at backward and
  run on the round thread's side stream while the learner's stream goes on;
- landing: a host tier on a CUDA plane (host rows composed in pinned buffers, landed by one
  non-blocking copy on the round's stream);
- tiers past overflow: device, pinned and host tiers, puts from the host, from GPU tensors,
  donated (``put(..., donate=True)``: packed by the round) and from a second Python thread
  (``two_ranks.tiers_donated_thread``);
- a checkpoint written while later rounds overwrite its slots
  (``two_ranks.checkpoint_while_overwritten``).

The sanitizer's dispatch mode is entered on the main thread only (torch's dispatch modes are
per thread); :func:`sanitize_threads` enters it on every thread the package starts too
(the round worker, the demoter, the checkpoint writer: ``conduit_dist.threads``), so the kernels
they launch are checked as well, and on the check's own put thread. Kernels of autograd's
device threads are not.

    CONDUIT_CUDA_BACKEND=gloo TORCH_CUDA_SANITIZER=1 \\
        torchrun --standalone --nproc_per_node=2 scripts/gpu_check/sanitizer.py

(``scripts/gpu_check/sanitize.py`` runs it so and reads its output.)
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
from common import DEVICE, DRY, THREAD_HOOKS, check, items, ok, verify
from two_ranks import checkpoint_while_overwritten, shared_dir, tiers_donated_thread

import conduit_dist as cd
from conduit_dist import threads

ITERS = 6  # fetches per scenario (the sanitizer slows every kernel launch)


def sanitize_threads() -> set[str]:
    """Enter the CUDA sanitizer's dispatch mode on every thread the package starts, as it sets
    the thread's device (``threads.bind_device``, which every package thread calls first), and
    on the check's own put thread (``common.put_in_thread``); in a dry run nothing is entered,
    the threads are only named. Returns the names of the threads seen so far (a live set)."""
    seen: set[str] = set()
    enter = None
    if not DRY:
        from torch.cuda._sanitizer import cuda_sanitizer
        from torch.utils._python_dispatch import _push_mode

        check(cuda_sanitizer.enabled, "the CUDA sanitizer is off: set TORCH_CUDA_SANITIZER=1")
        enter = lambda: _push_mode(cuda_sanitizer.dispatch)  # noqa: E731 (this thread's stack)
    bind = threads.bind_device

    def sanitize() -> None:
        if enter is not None:
            enter()
        seen.add(threading.current_thread().name.rsplit("_", 1)[0])

    def bind_and_sanitize(device: torch.device | None) -> None:
        bind(device)
        sanitize()

    threads.bind_device = bind_and_sanitize
    THREAD_HOOKS.append(sanitize)
    return seen


def overlapped(spec: cd.ExperienceSpec, rank: int, step: str) -> None:
    """Rounds launched at backward on the side stream, batches read on the learner's."""
    plane = cd.DataPlane(spec, 1024, seed=31, device=DEVICE, schedule="overlap")
    model = torch.nn.Linear(spec.fields["obs"].numel, 1).to(plane.device)
    plane.attach(model)
    rows, threads_seen = 0, set()
    for it in range(ITERS):
        plane.put(items(torch.arange(128) + 1000 * it + 1_000_000 * rank))
        b = plane.fetch(64)
        rows += verify(b, plane.device)
        threads_seen.add(plane.stats.thread)
        model(b["obs"].flatten(1).float()).sum().backward()
    schedule = plane.chosen_schedule
    plane.close()
    ok(step, f"{schedule} rounds on {sorted(threads_seen)}: {rows} rows checked")


def landing(spec: cd.ExperienceSpec, rank: int, step: str) -> None:
    """A host tier on a CUDA plane: rows composed on the host, landed by one pinned copy."""
    storage = cd.Tiers([("host", 1024)])
    plane = cd.DataPlane(spec, 1024, seed=32, device=DEVICE, schedule="overlap",
                         storage=storage)  # fmt: skip
    plan = plane.device_plan
    check(plan.rows == torch.device("cpu"), f"a host tier's rows on {plan.rows}, expected the host")
    model = torch.nn.Linear(spec.fields["obs"].numel, 1).to(plane.device)
    plane.attach(model)
    rows = 0
    for it in range(ITERS):
        base = 1000 * it + 1_000_000 * rank
        plane.put(items(torch.arange(base, base + 64)))
        plane.put(items(torch.arange(base + 500, base + 564), plane.device))
        b = plane.fetch(64)
        rows += verify(b, plane.device)
        model(b["obs"].flatten(1).float()).sum().backward()
    plane.close()
    ok(step, f"host rows landed on {plane.device}: {rows} rows checked ({plan.why})")


def main() -> None:
    """Run the sanitizer's scenarios."""
    check(DRY or torch.cuda.is_available(), "no CUDA device visible")
    check(dist.is_torchelastic_launched(), "run under torchrun (RANK, WORLD_SIZE, MASTER_*)")
    seen = sanitize_threads()
    cd.init_distributed(device=DEVICE)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        spec = cd.ExperienceSpec.from_batch(items(torch.arange(1)))
        step = f"s.{world}"  # s.1.overlap, s.2.overlap, ...: one set per world size
        overlapped(spec, rank, f"{step}.overlap")
        landing(spec, rank, f"{step}.landing")
        tiers_donated_thread(spec, rank, step=f"{step}.tiers")
        checkpoint_while_overwritten(spec, rank, shared_dir(), step=f"{step}.checkpoint")
        what = "without the sanitizer (a dry run)" if DRY else "under the CUDA sanitizer"
        check(bool(seen), "no package thread went through threads.bind_device")
        ok(f"{step}.done", f"{world} rank(s): every scenario ran {what}, on the main thread "
           f"and the {', '.join(sorted(seen))} threads")  # fmt: skip
    finally:
        cd.destroy_distributed()


if __name__ == "__main__":
    main()
