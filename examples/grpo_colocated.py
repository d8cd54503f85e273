# torchrun --standalone --nproc_per_node=2 examples/grpo_colocated.py --steps 300
# python examples/grpo_colocated.py --steps 300                                    # one process
"""GRPO through the token plane: a small causal LM learns to reverse digit strings.

Every rank generates prompt groups with the current policy (`reserve` first: it paces the
producer by policy version), scores them and `put`s them; every rank learns: `stream` hands it
token-balanced micro-batches of whole groups as soon as they are complete (the `produce`
callback generates between rounds), each micro-batch's gradient accumulates, one Adam step per
global batch (the learners average over all their response tokens), then `publish_weights`.
`train.py experiment=grpo` is the full job (metrics, W&B, disaggregated generators)."""

import argparse
import json
import time

import numpy as np
import torch
import torch.distributed as dist

import conduit_dist as cd
from conduit_dist.rl.grpo import (
    VOCAB,
    GRPOConfig,
    make_prompts,
    sample_groups,
    to_token_batch,
    token_spec,
)
from conduit_dist.rl.grpo_update import GRPOUpdate
from conduit_dist.rl.lm import LMConfig, TinyLM

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=300, help="global batches (one Adam step each)")
p.add_argument("--seed", type=int, default=0)
args = p.parse_args()

cd.init_distributed()  # torchrun's env, or a one-rank group under plain python
rank, world = dist.get_rank(), dist.get_world_size()
cfg = GRPOConfig(prompts_per_step=8, group_size=16, lr=5e-4, seed=args.seed)
torch.manual_seed(args.seed)  # the same initial weights on every rank
policy = TinyLM(LMConfig(vocab=VOCAB, max_len=cfg.max_digits + 1 + cfg.max_new))
update = GRPOUpdate(policy, cfg, dist.group.WORLD if world > 1 else None)
rng, gen = np.random.default_rng([args.seed, rank]), torch.Generator().manual_seed(rank)
seqs = 3 * cfg.prompts_per_step * cfg.group_size  # a shard holds max_policy_age + 2 batches
plane = cd.TokenPlane(
    token_spec(cfg), seqs, seqs * 16, max_policy_age=1, groups_per_batch=cfg.prompts_per_step
)
next_id, rewards, t0 = 0, [], time.perf_counter()


def produce() -> None:
    """Generate up to 2 groups, as many as pacing allows now (never waits)."""
    global next_id
    n = min(2, plane.allowance())
    if n:
        ids = [rank * 10**9 + next_id + i for i in range(n)]
        version = plane.reserve(ids)
        next_id += n
        groups = sample_groups(policy, make_prompts(n, rng, cfg.max_digits), 16, cfg.max_new, gen)
        plane.put(*to_token_batch(groups, ids), version=version)


with plane:
    for _ in range(args.steps):
        for mb in plane.stream(cfg.prompts_per_step, 2048, produce=produce):
            update.accumulate(mb.fields, mb.cu_seqlens, mb.max_seqlen)
            rewards.extend(mb["reward"].tolist())
        update.step()
        plane.publish_weights()
done = {"rank": rank, "steps": args.steps, "reward_first_100": float(np.mean(rewards[:100]))}
done.update(reward_100=float(np.mean(rewards[-100:])), wall_s=time.perf_counter() - t0)
# one write per rank (print's text and newline are two, which ranks sharing a pipe interleave)
print(json.dumps(done) + "\n", end="", flush=True)
cd.destroy_distributed()
