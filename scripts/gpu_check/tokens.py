"""Step (t) of the GPU check: the token plane on its device path.

Under ``torchrun``: world size 1 with NCCL (``nproc_per_node=1``), or 2 ranks sharing the GPU
(``CONDUIT_CUDA_BACKEND=gloo``). Every rank is a producer and a learner. Groups are put half from
GPU tensors (they stay on the device: the arenas are there), half from host tensors; each global
batch is taken by ``fetch`` with the next one's first round launched at a backward
(``attach``): checked are the bytes of every delivered sequence (each sequence's fields are a
function of its group and member ids, so a digest of what arrived is compared with a digest of
what was put), groups whole and delivered once, the micro-batches on the device, every launched
round after the first taken (``last_take.launched``), and where the plane put its arenas,
sections and weights (``store.device``, the group's backend). On odd steps the next batch is put
while the launched round runs (after the first backward): the put waits for the round and
writes the arenas after the round's reads on the device. Host syncs are counted
(``SyncWatch``): a ``fetch`` makes none, a put from host tensors none, a put from GPU tensors
at most two, each counted by the library (``token put lengths``, ``token put checks``); the
rounds' NCCL works are forgotten once done (``Exchange._device_works`` stays short).

In a dry run the plane is a CPU plane rehearsing the device path
(``CONDUIT_DEVICE_ROWS_REHEARSAL=1``): the same checks, on host tensors.

    torchrun --standalone --nproc_per_node=1 scripts/gpu_check/tokens.py
    CONDUIT_CUDA_BACKEND=gloo torchrun --standalone --nproc_per_node=2 scripts/gpu_check/tokens.py
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from common import DEVICE, DRY, SyncWatch, check, ok, rehearsal

import conduit_dist as cd

G, MAX_LEN, STEPS, PER_STEP, BUDGET = 4, 64, 6, 8, 400


def member(gid: int, m: int, device) -> dict[str, torch.Tensor]:
    """Sequence ``m`` of group ``gid`` (its content a function of the two ids)."""
    gen = torch.Generator().manual_seed(gid * 131 + m)
    n = int(torch.randint(1, MAX_LEN + 1, (1,), generator=gen))
    out = {
        "tokens": torch.randint(0, 50_000, (n,), dtype=torch.int32, generator=gen),
        "logprobs": -torch.rand(n, generator=gen),
        "reward": torch.rand((), generator=gen),
    }
    return {k: v.to(device) for k, v in out.items()}


def digest(fields: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in ("tokens", "logprobs", "reward"):
        h.update(fields[k].detach().to("cpu").contiguous().numpy().tobytes())
    return h.hexdigest()


def put_groups(tp: cd.TokenPlane, gids: list[int], device, watch: SyncWatch) -> None:
    """Whole groups in one put (packed fields and lengths), from tensors on ``device`` (made
    before the put: only the put's syncs are counted)."""
    seqs = [member(g, m, device) for g in gids for m in range(G)]
    lengths = torch.tensor([s["tokens"].shape[0] for s in seqs], device=device)
    batch = {k: torch.cat([s[k] for s in seqs]) for k in ("tokens", "logprobs")}
    batch["reward"] = torch.stack([s["reward"] for s in seqs])
    batch["group"] = torch.tensor(gids, device=device).repeat_interleave(G)
    with watch.count():
        tp.put(batch, lengths)


def state_digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for k, t in module.state_dict().items():
        h.update(k.encode() + t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def weights_check(spec: cd.TokenSpec, rank: int, world: int) -> str:
    """Weights on the device: at world size 1 a publish loaded in place (views of the device
    buffer); on 2 ranks learner 0 publishes with ``send_now`` to producer 1 (CUDA over gloo: a
    broadcast per part), which loads it in place: digests equal. Returns the schedule."""
    src = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 3)).to(DEVICE)
    dst = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 3)).to(DEVICE)
    if world == 1:
        from conduit_dist.flow.weights import WeightsState

        ws = WeightsState(torch.device(DEVICE) if not DRY else torch.device("cpu"))
        ws.publish(src)
        check(ws.pull(dst, in_place=True) == 1, "world size 1: no version loaded")
        check(ws.buf.device == dst[0].weight.device, f"weights on {ws.buf.device}")
        check(state_digest(src) == state_digest(dst), "world size 1: loaded weights differ")
        schedule = "none at world size 1"
    else:
        with (
            rehearsal(DRY),
            cd.TokenPlane(
                spec, 16, 4096, learner_ranks=[0], producer_ranks=[1], device=DEVICE
            ) as tp,
        ):
            if rank == 0:
                tp.publish_weights(src, send_now=True)
            else:
                tp.flush()
                check(tp.pull_weights(dst, in_place=True) == 1, "producer: version 1 not loaded")
                check(dst[0].weight.device == tp.weights.buf.device, "loaded off the buffer")
            schedule = tp.weights.last.schedule
    got = [None] * world
    dist.all_gather_object(got, state_digest(src if rank == 0 else dst))
    check(len(set(got)) == 1, f"weights digests differ across ranks: {got}")
    return schedule


def main() -> None:
    cd.init_distributed("cpu" if DRY else "cuda")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = cd.TokenSpec(
        {"tokens": cd.Ragged(torch.int32, MAX_LEN), "logprobs": cd.Ragged(torch.float32, MAX_LEN),
         "reward": ((), torch.float32)},
        group_size=G,
    )  # fmt: skip
    net = torch.nn.Linear(4, 1).to(DEVICE)
    with rehearsal(DRY), cd.TokenPlane(spec, 128, 16_384, device=DEVICE) as tp:
        dev = tp.device
        check(tp.store.device == dev, f"arenas on {tp.store.device}, plane on {dev}")
        check(tp.runner.one_thread, "rounds not on the plane's round thread")
        tp.attach(net)
        seen: dict[int, list[str]] = {}
        launched, works = [], []
        gpu_puts, host_puts, fetches = SyncWatch(), SyncWatch(), SyncWatch()

        def put_step(step: int) -> None:
            mine = [g for g in range(step * PER_STEP, (step + 1) * PER_STEP) if g % world == rank]
            half = len(mine) // 2  # half from GPU tensors, half from host tensors
            parts = ((mine[:half], dev, gpu_puts), (mine[half:], "cpu", host_puts))
            for part, where, watch in parts:
                if part:
                    put_groups(tp, part, where, watch)

        put_step(0)
        for step in range(STEPS):
            with fetches.count():
                mbs = tp.fetch(PER_STEP, BUDGET)
            launched.append(tp.last_take.launched)
            works.append(len(tp.ex._device_works))
            for k, mb in enumerate(mbs):
                check(mb.index == (k, len(mbs)) and mb.sequences > 0, f"micro-batch {mb.index}")
                check(mb["tokens"].device == dev, f"micro-batch on {mb['tokens'].device}")
                cu = mb.cu_seqlens.tolist()
                for i in range(mb.sequences):
                    gid = int(mb["group"][i])
                    f = {k2: mb[k2][cu[i] : cu[i + 1]] for k2 in ("tokens", "logprobs")}
                    f["reward"] = mb["reward"][i]
                    check(gid not in seen or seen[gid][0] == k, f"group {gid} split")
                    seen.setdefault(gid, [k]).append(digest(f))
            late = step % 2 == 1  # put while the launched round runs (after the first backward)
            if step + 1 < STEPS and not late:
                put_step(step + 1)
            for i, _ in enumerate(mbs):  # one backward per micro-batch: the first launches
                net(torch.randn(8, 4, device=dev)).sum().backward()
                if i == 0 and late and step + 1 < STEPS:
                    put_step(step + 1)
        for gid, got in seen.items():
            want = sorted(digest(member(gid, m, "cpu")) for m in range(G))
            check(sorted(got[1:]) == want, f"group {gid}: bytes differ from what was put")
        check(not launched[0] and all(launched[1:]), f"launched rounds taken: {launched}")
        # rounds' NCCL works: checked and forgotten at each round's start, not kept
        check(max(works) <= 16, f"NCCL works kept across rounds: {works}")
        # NCCL (world size 1): none; gloo moves CUDA tensors through the host (its own
        # copies): counted and reported, not bounded
        fetch_syncs = fetches.within(1, 0, 0, "fetch") if world == 1 else fetches.since(1)
        host_syncs = host_puts.within(0, 0, 0, "put from host tensors")
        gpu_syncs = gpu_puts.within(0, 2, 2, "put from GPU tensors")
    mine = torch.tensor([len(seen)], dtype=torch.int64)
    dist.all_reduce(mine)
    check(int(mine) == STEPS * PER_STEP, f"{int(mine)} groups delivered, {STEPS * PER_STEP} put")
    where = "world size 1, NCCL" if world == 1 else f"{world} ranks sharing the GPU"
    wsched = weights_check(spec, rank, world)
    ok(
        f"t.tokens{world}",
        f"{where}: {int(mine)} groups byte-identical and whole, micro-batches on {DEVICE}, "
        "arenas on the device, rounds launched at the backward taken (puts before and while "
        f"they ran); host syncs per fetch {fetch_syncs['torch_max']}, per GPU put "
        f"{gpu_syncs['torch_max']} (counted {gpu_syncs['library_max']}), per host put "
        f"{host_syncs['torch_max']}; weights ({wsched}) loaded equal from device buffers",
        groups=int(mine), world=world, fetch_syncs=fetch_syncs["torch_max"],
        gpu_put_syncs=gpu_syncs["torch_max"], host_put_syncs=host_syncs["torch_max"],
    )  # fmt: skip
    cd.destroy_distributed()


if __name__ == "__main__":
    main()
