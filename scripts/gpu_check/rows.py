"""Step (r) of the GPU check: rows stay on the device, world size 1.

For every sampler, a plane delivering on the GPU (``device="cuda"``: the default storage's one
tier on the GPU, rows composed there, ``rounds/devices.py``) and a plane on the host
(``device="cpu"``: the native path) take the same puts with the same seed in the ``sync``
schedule, with priority updates where the sampler takes them (on the GPU plane computed on the
GPU, queued at the next fetch; on the host plane queued at once): every batch must be equal, byte
for byte (``tests/test_device_rows.py`` shows the device-rows logic equal to the native path on
the CPU; this shows it on a GPU). The GPU plane's rows and first tier must be on the GPU, and its
host syncs stay within :data:`TORCH_SYNCS` and :data:`LIBRARY_SYNCS` per iteration (one put, one
fetch, one ``update_priorities``), counted by ``torch.cuda.set_sync_debug_mode("warn")`` and
``conduit_dist.syncs``.

In a dry run the GPU plane is a CPU plane rehearsing the device-rows path
(``CONDUIT_DEVICE_ROWS_REHEARSAL=1``): the same comparison, against the native path.

    python scripts/gpu_check/rows.py
"""

from __future__ import annotations

import contextlib

import torch
from common import (
    DEVICE,
    DRY,
    SyncWatch,
    check,
    items,
    ok,
    rehearsal,
    stream_ids,
    tier,
    verify,
)

import conduit_dist as cd
from conduit_dist.sampling.base import RoutesFeedback

# Host syncs one iteration (a put of host items, a fetch, an update_priorities of GPU values)
# may make in the steady state, world size 1, device rows, no max_policy_age:
TORCH_SYNCS = 0
# torch's own: none. Draws, trees and stream links are host metadata; indices, trailers
# (addresses, masses) and n-step values go up through pinned memory without blocking
# (tiers.cuda.upload, IndexUpload); staged host rows go up by one non-blocking copy from pinned
# staging; GPU priorities come down to pinned memory without blocking (plane/consumer.py _Later);
# the link columns of windows come from the host staging rows (ColumnShadow.fill). An age check
# (max_policy_age) would add one read per fetch (flow/versions.check_ages): not set here.
LIBRARY_SYNCS = 1
# conduit_dist.syncs, each only when the GPU is behind the host (an event not yet passed):
# "priority updates" (the last fetch's GPU priorities not landed in pinned memory when this
# fetch queues them) or "staging reuse" (a put reusing the staging buffer whose upload has not
# run). Here the loop reads each batch back to compare it, so both have passed: 0 expected.

KINDS = {
    "uniform": lambda: "uniform",
    "stratified": lambda: "stratified",
    "prioritized": lambda: cd.Prioritized(alpha=0.6, beta=0.4),
    "n_step": lambda: cd.Prioritized(
        alpha=0.6,
        beta=0.4,
        sequence=cd.Windows(n_step=3, gamma=0.9, stream="env", truncated="truncated"),
    ),
    "slices": lambda: cd.Prioritized(
        alpha=0.0,
        beta=0.0,
        eps=0.0,
        sequence=cd.Windows(length=4, burn_in=1, stream="env", truncated="truncated"),
    ),
    "fifo": lambda: cd.Fifo(),
    "without_replacement": lambda: cd.WithoutReplacement(epochs=2),
}
ENVS, STEPS = 8, 8  # a put: STEPS consecutive steps of each of ENVS streams
ROUNDS, WARM, BATCH = (10, 3, 32) if DRY else (16, 4, 32)  # iterations; WARM only put + flush


def stream_batch(t: int) -> dict[str, torch.Tensor]:
    """Steps ``t*STEPS .. t*STEPS+STEPS-1`` of streams ``0..ENVS-1`` (host tensors), with
    episode ends: ``done`` every 11th step, ``truncated`` every 13th."""
    steps = torch.arange(t * STEPS, (t + 1) * STEPS)
    ids = torch.cat([stream_ids(0, e, steps) for e in range(ENVS)])
    batch = items(ids)
    step = ids % 1_000_000
    batch["done"] = step % 11 == 10
    batch["truncated"] = step % 13 == 12
    return batch


def _plane(kind: str, device: str, rehearse: bool) -> cd.DataPlane:
    """A world-size-1 ``sync`` plane; ``rehearse``: the device-rows path on a CPU plane."""
    spec = cd.ExperienceSpec.from_batch(stream_batch(0))
    with rehearsal(rehearse):
        return cd.DataPlane(spec, 1024, seed=21, device=device, schedule="sync",
                            sampler=KINDS[kind]())  # fmt: skip


def _batches(plane: cd.DataPlane, watch: SyncWatch | None) -> list[dict[str, torch.Tensor]]:
    """The plane's batches (host copies), each iteration's put, fetch and priority update
    counted by ``watch``."""
    feedback = isinstance(plane.sampler, RoutesFeedback)
    out = []
    for t in range(ROUNDS):
        batch = stream_batch(t)
        if t < WARM:
            plane.put(batch)
            plane.flush()
            continue
        with watch.count() if watch is not None else contextlib.nullcontext():
            plane.put(batch)
            b = plane.fetch(BATCH, oversample=True)
            if feedback:  # on the batch's device: GPU priorities on the GPU plane
                plane.update_priorities(b["_index"], (b["_index"] % 7).double() * 0.5 + 0.25)
        verify(b, plane.device)
        out.append({k: v.to("cpu", copy=True) for k, v in b.items()})
    return out


def one_sampler(kind: str) -> dict[str, object]:
    """Compare the device plane's batches with the host plane's; check where its rows are and
    its host syncs."""
    host = _plane(kind, "cpu", rehearse=False)
    want = _batches(host, None)
    check(host.device_plan.compose == "native", f"{kind}: host plane {host.device_plan}")
    host.close()
    dev = _plane(kind, DEVICE, rehearse=DRY)
    plan, watch = dev.device_plan, SyncWatch()
    got = _batches(dev, watch)
    first = dev.store_stats()["tiers"][0]["kind"]
    dev.close()
    check(plan.compose == "torch", f"{kind}: rows not composed on the device path: {plan}")
    check(plan.rows == dev.device, f"{kind}: rows on {plan.rows}, batches on {dev.device}")
    check(first == tier("device"), f"{kind}: first tier {first!r}, expected {tier('device')!r}")
    check(len(got) == len(want) > 0, f"{kind}: {len(got)} batches against {len(want)}")
    for i, (a, b) in enumerate(zip(want, got)):
        check(a.keys() == b.keys(), f"{kind}, fetch {i}: keys {sorted(b)} != {sorted(a)}")
        for key in a:
            check(torch.equal(a[key], b[key]), f"{kind}, fetch {i}: {key!r} differs from cpu")
    syncs = watch.within(2, TORCH_SYNCS, LIBRARY_SYNCS, f"{kind} (put + fetch + update)")
    return {"rows": str(plan.rows), "fetches": len(got), **syncs}


def main() -> None:
    """Run step (r)."""
    check(DRY or torch.cuda.is_available(), "no CUDA device visible")
    results = {kind: one_sampler(kind) for kind in KINDS}
    rows = {r["rows"] for r in results.values()}
    ok(
        "r.exact",
        f"{len(KINDS)} samplers ({', '.join(KINDS)}): every batch of the plane on {DEVICE} "
        f"equal to the cpu plane's ({sum(r['fetches'] for r in results.values())} fetches, "
        f"with priority updates); rows and first tier on {', '.join(sorted(rows))}",
    )
    torch_max = max(r["torch_max"] for r in results.values())
    lib_max = max(r["library_max"] for r in results.values())
    per = ", ".join(
        f"{k} {r['torch_mean']:.2f}/{r['library_mean']:.2f}" for k, r in results.items()
    )
    ok(
        "r.syncs",
        f"host syncs per iteration (put + fetch + update_priorities), torch/library mean: "
        f"{per}; most in one iteration: torch {torch_max} (budget {TORCH_SYNCS}), library "
        f"{lib_max} (budget {LIBRARY_SYNCS})",
        torch_syncs_max=torch_max,
        library_syncs_max=lib_max,
        syncs={
            k: {"torch": r["torch_mean"], "library": r["library_mean"]} for k, r in results.items()
        },
    )


if __name__ == "__main__":
    main()
