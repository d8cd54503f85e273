# torchrun --standalone --nproc_per_node=2 examples/colocated_dqn.py --env-steps 100000
# python examples/colocated_dqn.py --env-steps 100000        # one process (world size 1)
"""Colocated double DQN on CartPole: every rank acts, puts its transitions into the data plane
and learns from its share of each batch, drawn uniformly from every rank's shard.
Gradients are averaged by DDP over gloo, the plainest correct choice, which leaves the round free
to overlap: `plane.attach(qnet)` launches the next fetch's round when backward starts, so it runs
behind backward, the optimizer step, the env step and the put. (Averaging inside the round,
`fetch(b, reduce=flat_grads)`, saves DDP's collective but needs schedule="sync".)"""

import argparse
import copy
import json
import math
import time
from collections import deque

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import conduit_dist as cd
from conduit_dist.extras import require

with require("train", "examples/colocated_dqn.py"):  # pip install -e ".[train]"
    import gymnasium as gym

parser = argparse.ArgumentParser()
parser.add_argument("--env-steps", type=int, default=100_000, help="over all ranks")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--num-envs", type=int, default=4, help="per rank")
parser.add_argument("--batch", type=int, default=128, help="per update, over all ranks")
args = parser.parse_args()
GAMMA, LR, TAU, LEARNING_STARTS, EPS_STEPS = 0.99, 1e-3, 0.01, 1000, 10_000
SAME_STEP = {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}  # one transition per step
SPEC = {"obs": ((4,), torch.float32), "action": ((), torch.int64), "reward": ((), torch.float32)}
SPEC.update(next_obs=((4,), torch.float32), done=((), torch.bool))


def env_step(envs, obs, action, returns):
    """Step the envs: the transitions (next_obs: an ended episode's last) and the next obs."""
    nxt, rew, term, _, info = envs.step(action.numpy())
    next_obs = nxt.copy()
    if "_final_obs" in info:  # same-step autoreset: nxt holds the reset observation there
        next_obs[info["_final_obs"]] = np.stack(info["final_obs"][info["_final_obs"]])
    if "_episode" in info:  # RecordEpisodeStatistics: the returns of the episodes that ended
        returns.extend(info["episode"]["r"][info["_episode"]].tolist())
    t = {"obs": obs, "action": action, "reward": torch.as_tensor(rew, dtype=torch.float32)}
    t.update(next_obs=torch.as_tensor(next_obs), done=torch.as_tensor(term))  # truncated: bootstrap
    return t, torch.as_tensor(nxt)


def td_loss(learner, qnet, target, b):
    q = learner(b["obs"]).gather(1, b["action"][:, None]).squeeze(1)
    with torch.no_grad():  # double DQN: the online net picks, the target net values
        a = qnet(b["next_obs"]).argmax(1, keepdim=True)
        y = b["reward"] + GAMMA * (~b["done"]).float() * target(b["next_obs"]).gather(1, a)[:, 0]
    return F.smooth_l1_loss(q, y)


def train(plane, rank, world):
    envs = gym.make_vec("CartPole-v1", args.num_envs, "sync", vector_kwargs=SAME_STEP)
    envs = gym.wrappers.vector.RecordEpisodeStatistics(envs)
    obs = torch.as_tensor(envs.reset(seed=args.seed + 1000 * rank)[0])
    qnet = nn.Sequential(
        nn.Linear(4, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 2)
    )
    target = copy.deepcopy(qnet).requires_grad_(False)
    learner = nn.parallel.DistributedDataParallel(qnet)  # averages gradients over the ranks
    opt = torch.optim.Adam(qnet.parameters(), lr=LR)
    plane.attach(qnet)  # the next round starts when qnet's backward starts
    returns, env_steps = deque(maxlen=100), 0
    for it in range(math.ceil(args.env_steps / (args.num_envs * world))):
        eps = max(0.05, 1.0 - env_steps / EPS_STEPS)
        with torch.no_grad():
            action = qnet(obs).argmax(1)
        action = torch.where(torch.rand(len(action)) < eps, torch.randint(2, action.shape), action)
        transitions, obs = env_step(envs, obs, action, returns)
        plane.put(transitions)  # staged for the next round (placement="local": kept here)
        env_steps += args.num_envs * world
        if env_steps < LEARNING_STARTS:
            plane.flush()  # take part in the round without fetching
            continue
        batch = plane.fetch(args.batch // world)  # this rank's share, from every shard
        loss = td_loss(learner, qnet, target, batch)
        opt.zero_grad()
        loss.backward()  # the next round runs meanwhile; DDP averages the gradients
        nn.utils.clip_grad_norm_(qnet.parameters(), 10.0)
        opt.step()
        with torch.no_grad():
            for t, s in zip(target.parameters(), qnet.parameters()):
                t.lerp_(s, TAU)
        if rank == 0 and it % 1000 == 0:
            mean = np.mean(list(returns) or [np.nan])  # this rank's last 100 episodes
            print(f"env_steps {env_steps} return_100 {mean:.1f} loss {loss.item():.3f}")
    envs.close()
    return env_steps, list(returns)


def main():
    cd.init_distributed()  # torchrun's env, or a one-rank group under plain python
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(args.seed + rank)
        start = time.perf_counter()
        plane = cd.DataPlane(cd.ExperienceSpec(SPEC), 50_000, seed=args.seed, placement="local")
        try:  # schedule="overlap" is the default
            env_steps, returns = train(plane, rank, world)
        finally:
            plane.close()  # collective: every rank closes
        parts = [None] * world  # the last 100 episodes over all ranks
        dist.all_gather_object(parts, returns[-math.ceil(100 / world) :])
        recent = [r for p in parts for r in p]
        if rank == 0:
            out = {"env_steps": env_steps, "return_100": float(np.mean(recent)) if recent else None}
            print(json.dumps({**out, "wall_s": round(time.perf_counter() - start, 1)}))
    finally:
        cd.destroy_distributed()


if __name__ == "__main__":
    main()
