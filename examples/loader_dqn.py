# python examples/loader_dqn.py
# torchrun --standalone --nproc_per_node=2 examples/loader_dqn.py --env-steps 100000
"""Double DQN on CartPole fed through ``cd.ExperienceLoader``: the loader runs the rounds (put
what ``collect`` returns, warm up, fetch), the loop body only trains. Every rank acts and learns;
its batch is drawn uniformly from the store of every rank, and the next round is launched at the
Q-network's backward (``model=q``), so it runs behind the backward and the optimizer step."""

from __future__ import annotations

import argparse
import copy
import json
import time
from collections import deque

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import conduit_dist as cd
from conduit_dist.extras import require

with require("train", "examples/loader_dqn.py"):  # pip install -e ".[train]"
    import gymnasium as gym
    from gymnasium.vector import AutoresetMode, SyncVectorEnv

ap = argparse.ArgumentParser()
ap.add_argument("--env-steps", type=int, default=100_000, help="over all ranks")
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--envs", type=int, default=4, help="per rank")
ap.add_argument("--batch", type=int, default=128, help="the update's batch, over all ranks")
ap.add_argument("--learning-starts", type=int, default=2_000, help="items stored, all ranks")
args = ap.parse_args()

cd.init_distributed()  # gloo on CPU; a no-op without torchrun
rank, world = cd.get_rank(), cd.get_world_size()
torch.manual_seed(args.seed)  # the same initial weights on every rank
rng = np.random.default_rng(args.seed * 100 + rank)
envs = SyncVectorEnv(
    [lambda: gym.make("CartPole-v1")] * args.envs, autoreset_mode=AutoresetMode.SAME_STEP
)
obs = torch.as_tensor(envs.reset(seed=args.seed * 100 + rank * args.envs)[0])
q = nn.Sequential(nn.Linear(4, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 2))
target = copy.deepcopy(q)
learner = DDP(q) if world > 1 else q  # gradients averaged over the ranks
opt = torch.optim.Adam(q.parameters(), lr=1e-3)
returns, ep_ret, steps = deque(maxlen=100), np.zeros(args.envs), 0


def collect() -> dict[str, torch.Tensor]:
    """One step of this rank's envs (epsilon-greedy): the transitions to put."""
    global obs, steps
    eps = max(0.01, 1.0 - steps / 20_000)
    with torch.no_grad():
        greedy = q(obs).argmax(1).numpy()
    act = np.where(rng.random(args.envs) < eps, rng.integers(0, 2, args.envs), greedy)
    nxt, rew, term, trunc, info = envs.step(act)
    final = nxt.copy()
    for i in np.nonzero(info.get("_final_obs", []))[0]:
        final[i] = info["final_obs"][i]  # same-step autoreset: nxt[i] is the reset obs
    ep_ret[:] += rew
    for i in np.nonzero(term | trunc)[0]:
        returns.append(float(ep_ret[i]))
        ep_ret[i] = 0.0
    item = {
        "obs": obs,
        "action": torch.as_tensor(act),
        "reward": torch.as_tensor(rew, dtype=torch.float32),
        "next_obs": torch.as_tensor(final),
        "done": torch.as_tensor(term),  # a truncated episode still bootstraps
    }
    obs, steps = torch.as_tensor(nxt), steps + args.envs * world
    return item


example = {"obs": obs, "action": torch.zeros(args.envs, dtype=torch.int64),
           "reward": torch.zeros(args.envs), "next_obs": obs,
           "done": torch.zeros(args.envs, dtype=torch.bool)}  # fmt: skip
spec = cd.ExperienceSpec.from_batch(example)  # fields, dtypes and shapes of one item
plane = cd.DataPlane(spec, capacity_per_rank=50_000, seed=args.seed, placement="local")
loader = cd.ExperienceLoader(
    plane,
    batch_size=args.batch // world,  # each learner's share of the update
    collect=collect,
    min_size=args.learning_starts,  # items over all shards before the first update
    rounds=args.env_steps // (args.envs * world),
    model=q,  # schedule="overlap": the next round starts at this module's backward
)
start = time.perf_counter()
try:
    for batch in loader:
        with torch.no_grad():
            best = q(batch["next_obs"]).argmax(1, keepdim=True)  # double DQN
            nq = target(batch["next_obs"]).gather(1, best).squeeze(1)
            y = batch["reward"] + 0.99 * nq * (~batch["done"]).float()
        pred = learner(batch["obs"]).gather(1, batch["action"][:, None]).squeeze(1)
        loss = F.smooth_l1_loss(pred, y)
        opt.zero_grad()
        loss.backward()  # DDP averages the gradients; the next round flies meanwhile
        nn.utils.clip_grad_norm_(q.parameters(), 10.0)
        opt.step()
        with torch.no_grad():  # soft target update
            for t, p in zip(target.parameters(), q.parameters()):
                t.lerp_(p, 0.01)
        if rank == 0 and loader.batches % 1000 == 0:
            print(f"env_steps={steps} return_100={np.mean(returns or [0]):.1f} "
                  f"exposed_ms={loader.exposed_ms / loader.batches:.2f} "
                  f"hidden_ms={loader.hidden_ms / loader.batches:.2f}", flush=True)  # fmt: skip
finally:
    plane.close()
    envs.close()
    cd.destroy_distributed()
if rank == 0:
    print(json.dumps({
        "env_steps": steps, "return_100": float(np.mean(returns or [0])),
        "updates": loader.batches, "rounds": loader.rounds_run,
        "exposed_ms_per_update": loader.exposed_ms / max(loader.batches, 1),
        "hidden_ms_per_update": loader.hidden_ms / max(loader.batches, 1),
        "wall_s": time.perf_counter() - start,
    }))  # fmt: skip
