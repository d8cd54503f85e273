"""Step (t) of the GPU check: the token plane on its device path.

Under ``torchrun``: world size 1 with NCCL (``nproc_per_node=1``), or 2 ranks sharing the GPU
(``CONDUIT_CUDA_BACKEND=gloo``). Every rank is a producer and a learner. Groups are put half from
GPU tensors (they stay on the device: the arenas are there), half from host tensors; each global
batch is taken by ``fetch`` with the next one's first round launched at a backward
(``attach``): checked are the bytes of every delivered sequence (each sequence's fields are a
function of its group and member ids, so a digest of what arrived is compared with a digest of
what was put), groups whole and delivered once, the micro-batches on the device, every launched
round after the first taken (``last_take.launched``), and where the plane put its arenas,
sections and weights (``store.device``, the group's backend).

In a dry run the plane is a CPU plane rehearsing the device path
(``CONDUIT_DEVICE_ROWS_REHEARSAL=1``): the same checks, on host tensors.

    torchrun --standalone --nproc_per_node=1 scripts/gpu_check/tokens.py
    CONDUIT_CUDA_BACKEND=gloo torchrun --standalone --nproc_per_node=2 scripts/gpu_check/tokens.py
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from common import DEVICE, DRY, check, ok, rehearsal

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


def put_groups(tp: cd.TokenPlane, gids: list[int], device) -> None:
    """Whole groups in one put (packed fields and lengths), from tensors on ``device``."""
    seqs = [member(g, m, device) for g in gids for m in range(G)]
    lengths = torch.tensor([s["tokens"].shape[0] for s in seqs], device=device)
    batch = {k: torch.cat([s[k] for s in seqs]) for k in ("tokens", "logprobs")}
    batch["reward"] = torch.stack([s["reward"] for s in seqs])
    batch["group"] = torch.tensor(gids, device=device).repeat_interleave(G)
    tp.put(batch, lengths)


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
        launched = []

        def put_step(step: int) -> None:
            mine = [g for g in range(step * PER_STEP, (step + 1) * PER_STEP) if g % world == rank]
            half = len(mine) // 2  # half from GPU tensors, half from host tensors
            for part, where in ((mine[:half], dev), (mine[half:], "cpu")):
                if part:
                    put_groups(tp, part, where)

        put_step(0)
        for step in range(STEPS):
            mbs = tp.fetch(PER_STEP, BUDGET)
            launched.append(tp.last_take.launched)
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
            if step + 1 < STEPS:
                put_step(step + 1)
            for _ in mbs:  # one backward per micro-batch: the first launches the next round
                net(torch.randn(8, 4, device=dev)).sum().backward()
        for gid, got in seen.items():
            want = sorted(digest(member(gid, m, "cpu")) for m in range(G))
            check(sorted(got[1:]) == want, f"group {gid}: bytes differ from what was put")
        check(not launched[0] and all(launched[1:]), f"launched rounds taken: {launched}")
    mine = torch.tensor([len(seen)], dtype=torch.int64)
    dist.all_reduce(mine)
    check(int(mine) == STEPS * PER_STEP, f"{int(mine)} groups delivered, {STEPS * PER_STEP} put")
    where = "world size 1, NCCL" if world == 1 else f"{world} ranks sharing the GPU"
    ok(
        f"t.tokens{world}",
        f"{where}: {int(mine)} groups byte-identical and whole, micro-batches on {DEVICE}, "
        "arenas on the device, rounds launched at the backward taken",
        groups=int(mine), world=world,
    )  # fmt: skip
    cd.destroy_distributed()


if __name__ == "__main__":
    main()
