"""A token plane that survives losing a host: learners under an elastic ``torchrun``, producers
attached from outside the job (docs/attach.md, docs/reliability.md).

    torchrun --nnodes=1:2 --nproc_per_node=2 --max-restarts=3 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST_A:29511 --rdzv-id=job1 examples/elastic_tokens.py RUN_DIR STEPS
    python tests/attached_producer.py RUN_DIR/ingress p0 0 tokens 0 100000 stream   # any time

Every rank learns: each step it ``fetch``es 2 groups a rank, and every 3 steps the job
checkpoints the plane (``RUN_DIR/ckpt``; rank 0 writes the step it holds). When a host is lost,
the survivors' collectives fail, torchrun restarts them on the hosts that are left, and this
program restores the last checkpoint onto the new world size, reopens its ingresses (the
attached producers find them again by themselves) and goes on from that step; each producer's
puts acknowledged after the checkpoint are counted lost in the ledger. Each rank writes the
groups it took (``delivered-*.jsonl``) and, at the end, its ledger (``ledger-*.json``) under
``RUN_DIR``.
"""

from __future__ import annotations

import json
import os
import sys

import torch

import conduit_dist as cd

G, MAX_LEN = 4, 96


def spec() -> cd.TokenSpec:
    return cd.TokenSpec(
        {
            "tokens": cd.Ragged(torch.int32, MAX_LEN),
            "logprobs": cd.Ragged(torch.float32, MAX_LEN),
            "loss_mask": cd.Ragged(torch.bool, MAX_LEN),
            "reward": ((), torch.float32),
        },
        group_size=G,
    )


def main(run_dir: str, steps: int) -> None:
    cd.init_distributed(timeout_s=20)
    rank, world = cd.get_rank(), cd.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    ckpt, marker = os.path.join(run_dir, "ckpt"), os.path.join(run_dir, "ckpt-step.json")
    tp = cd.TokenPlane(spec(), 1024, 1024 * MAX_LEN, transport=cd.TransportConfig(timeout_s=20))
    start = 0
    if os.path.exists(os.path.join(ckpt, "tokens-manifest.json")):
        tp.restore(ckpt)
        with open(marker) as f:
            start = json.load(f)["step"]
    tp.open_ingress(os.path.join(run_dir, "ingress"), timeout_s=5, grace_s=60)
    out = open(os.path.join(run_dir, f"delivered-r{restart}-rank{rank}.jsonl"), "a")  # noqa: SIM115
    for step in range(start, steps):
        gids = sorted({g for mb in tp.fetch(2 * world, 4096, wait_s=120)
                       for g in mb["group"].tolist()})  # fmt: skip
        out.write(json.dumps({"step": step, "world": world, "groups": gids}) + "\n")
        out.flush()
        if (step + 1) % 3 == 0:
            tp.checkpoint(ckpt)
            if rank == 0:
                tmp = f"{marker}.tmp"
                with open(tmp, "w") as f:
                    json.dump({"step": step + 1, "world": world}, f)
                os.replace(tmp, marker)
    with open(os.path.join(run_dir, f"ledger-r{restart}-rank{rank}.json"), "w") as f:
        json.dump({"world": world, "ledger": tp.ledger()}, f)
    tp.close()
    cd.destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
