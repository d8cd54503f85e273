# torchrun --standalone --nproc_per_node=3 examples/disaggregated_dqn.py --env-steps 100000
# torchrun --standalone --nproc_per_node=2 examples/disaggregated_dqn.py  # learner + 1 actor
"""Disaggregated double DQN on CartPole: rank 0 learns, every other rank acts.

Actors step their envs with their copy of the Q-net, `put` the transitions, `flush` (their part
of the round: a learner's fetch and the actors' flushes make one round, one per iteration on
every rank, so the loops stay in step) and `pull_weights`, which loads the newest weights that
arrived and returns their version (items put afterwards carry it). The learner `fetch`es a batch
drawn uniformly from the actors' shards, trains, and `publish_weights` every PUBLISH_EVERY
iterations (one update each; broadcast in the next round)."""

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

with require("train", "examples/disaggregated_dqn.py"):  # pip install -e ".[train]"
    import gymnasium as gym

parser = argparse.ArgumentParser()
parser.add_argument("--env-steps", type=int, default=100_000, help="over all actors")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--num-envs", type=int, default=4, help="per actor")
parser.add_argument("--batch", type=int, default=128)
args = parser.parse_args()
GAMMA, LR, TAU, LEARNING_STARTS, EPS_STEPS, PUBLISH_EVERY = 0.99, 1e-3, 0.01, 1000, 10_000, 4
# max_policy_age: no item more than MAX_AGE versions (MAX_AGE x PUBLISH_EVERY updates) older
# than the newest is replayed; the shards evict such items at each round (counted in
# store_stats()["stale_evicted"]). With 2 actors x 4 envs that is the newest 16k transitions:
# the age bound, not the capacity (50k per shard), sets the replay window here.
MAX_AGE = 500
SAME_STEP = {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}  # one transition per step
SPEC = {"obs": ((4,), torch.float32), "action": ((), torch.int64), "reward": ((), torch.float32)}
SPEC.update(next_obs=((4,), torch.float32), done=((), torch.bool))


def q_network():
    return nn.Sequential(
        nn.Linear(4, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 2)
    )


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


def act(plane, rank, iters, n_actors):
    """An actor: returns its last episodes' returns and the version it acted with last."""
    envs = gym.make_vec("CartPole-v1", args.num_envs, "sync", vector_kwargs=SAME_STEP)
    envs = gym.wrappers.vector.RecordEpisodeStatistics(envs)
    obs = torch.as_tensor(envs.reset(seed=args.seed + 1000 * rank)[0])
    qnet, returns, version = q_network(), deque(maxlen=100), 0
    for it in range(1, iters + 1):
        eps = max(0.05, 1.0 - it * args.num_envs * n_actors / EPS_STEPS)
        with torch.no_grad():
            action = qnet(obs).argmax(1)
        action = torch.where(torch.rand(len(action)) < eps, torch.randint(2, action.shape), action)
        transitions, obs = env_step(envs, obs, action, returns)
        plane.put(transitions)  # carries `version`; stays in this actor's shard
        plane.flush()  # this iteration's round (in the background: schedule="overlap")
        version = plane.pull_weights(qnet)  # the newest weights received; 0 before the first
        if rank == 1 and it % 1000 == 0:
            mean = np.mean(list(returns) or [np.nan])
            steps = it * args.num_envs * n_actors
            print(f"env_steps {steps} return_100 {mean:.1f} acting with policy version {version}")
    envs.close()
    return list(returns), version


def learn(plane, iters, n_actors):
    """The learner: returns no episodes and the version it published last."""
    qnet = q_network()
    target = copy.deepcopy(qnet).requires_grad_(False)
    opt = torch.optim.Adam(qnet.parameters(), lr=LR)
    plane.attach(qnet)  # the next round starts at backward: it overlaps backward and the step
    version = plane.publish_weights(qnet)  # the actors' first weights (version 1)
    for it in range(1, iters + 1):
        if it * args.num_envs * n_actors < LEARNING_STARTS:
            plane.flush()  # the round without fetching
            continue
        # No wait_s: earlier rounds stored the actors' items (and extra rounds run while waiting
        # would not be matched by the actors' one round per iteration).
        b = plane.fetch(args.batch)
        q = qnet(b["obs"]).gather(1, b["action"][:, None]).squeeze(1)
        with torch.no_grad():  # double DQN: the online net picks, the target net values
            a = qnet(b["next_obs"]).argmax(1, keepdim=True)
            nq = target(b["next_obs"]).gather(1, a)[:, 0]
            y = b["reward"] + GAMMA * (~b["done"]).float() * nq
        loss = F.smooth_l1_loss(q, y)
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(qnet.parameters(), 10.0)
        opt.step()
        with torch.no_grad():
            for t, s in zip(target.parameters(), qnet.parameters()):
                t.lerp_(s, TAU)
        if it % PUBLISH_EVERY == 0:
            version = plane.publish_weights(qnet)  # sent in the next round; actors pull it
    return [], version


def main():
    cd.init_distributed()
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if world < 2:
            raise SystemExit(f"disaggregated_dqn: needs a learner and an actor, got {world} rank")
        torch.manual_seed(args.seed + rank)
        n_actors = world - 1
        iters = math.ceil(args.env_steps / (args.num_envs * n_actors))
        start = time.perf_counter()
        plane = cd.DataPlane(
            cd.ExperienceSpec(SPEC),
            capacity_per_rank=50_000,
            seed=args.seed,
            learner_ranks=[0],
            placement="local",  # each actor's items stay in its shard, in version order
            max_policy_age=MAX_AGE,
        )
        try:
            if rank == 0:
                returns, version = learn(plane, iters, n_actors)
            else:
                returns, version = act(plane, rank, iters, n_actors)
            stale = plane.store_stats()["stale_evicted"]
        finally:
            plane.close()  # collective: every rank closes
        parts = [None] * world  # the last 100 episodes over all actors, and the evictions
        dist.all_gather_object(parts, (returns[-math.ceil(100 / n_actors) :], stale))
        recent = [r for p, _ in parts for r in p]
        if rank == 0:
            out = {"env_steps": iters * args.num_envs * n_actors}
            out["return_100"] = float(np.mean(recent)) if recent else None
            out.update(policy_version=version, stale_evicted=sum(s for _, s in parts))
            print(json.dumps({**out, "wall_s": round(time.perf_counter() - start, 1)}))
    finally:
        cd.destroy_distributed()


if __name__ == "__main__":
    main()
