# torchrun --standalone --nproc_per_node=2 examples/ppo_queue.py --env-steps 100000  # colocated
# torchrun --standalone --nproc_per_node=3 examples/ppo_queue.py --disaggregated     # 1 + 2 actors
# python examples/ppo_queue.py --env-steps 100000                                   # one process
"""PPO on CartPole with rollouts through a queue (`sampler=cd.Fifo()`).

Acting ranks collect `--num-steps` steps of their envs, compute GAE on their side (they hold the
values they acted with) and `put` the rollout; the queue hands every item to exactly one learner,
once, and each learner takes its whole share in one `fetch`, then runs epochs x minibatches on it
locally (several learners average gradients with DDP). Learners `publish_weights` after each
update. Colocated (default) every rank acts and learns; `--disaggregated`: rank 0 learns, the
others act and pull the new weights before their next rollout. `max_policy_age=0`: no learner
ever trains on a rollout collected by an older policy (a stale item is evicted or refused)."""

import argparse
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

with require("train", "examples/ppo_queue.py"):  # pip install -e ".[train]"
    import gymnasium as gym

parser = argparse.ArgumentParser()
parser.add_argument("--env-steps", type=int, default=100_000, help="over all acting ranks")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--num-envs", type=int, default=2, help="per acting rank")
parser.add_argument("--num-steps", type=int, default=128, help="rollout length")
parser.add_argument("--disaggregated", action="store_true", help="rank 0 learns, others act")
args = parser.parse_args()
LR, GAMMA, LAM, CLIP, ENT, VF, EPOCHS, MINIBATCHES = 2.5e-4, 0.99, 0.95, 0.2, 0.01, 0.5, 4, 4
SAME_STEP = {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}  # one transition per step
SPEC = {k: ((), torch.float32) for k in ("logp", "value", "adv", "ret")}  # one rollout item
SPEC.update(obs=((4,), torch.float32), action=((), torch.int64))


def mlp(n_out, std):  # CleanRL's: tanh, orthogonal initialisation
    layers = [nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, n_out)]
    for layer, gain in zip(layers[::2], (2**0.5, 2**0.5, std)):
        nn.init.orthogonal_(layer.weight, gain)
        nn.init.zeros_(layer.bias)
    return nn.Sequential(*layers)


class ActorCritic(nn.Module):
    def __init__(self):
        super().__init__()
        self.pi, self.v = mlp(2, 0.01), mlp(1, 1.0)

    def forward(self, obs):
        return self.pi(obs), self.v(obs).squeeze(-1)


@torch.no_grad()
def collect(envs, obs, net, returns):
    """One rollout with GAE; returns its items [T * E] and the next observations."""
    keys = ("obs", "action", "logp", "value", "reward", "next_obs", "term", "end")
    steps = {k: [] for k in keys}
    for _ in range(args.num_steps):
        logits, value = net(obs)
        pi = torch.distributions.Categorical(logits=logits)
        action = pi.sample()
        nxt, rew, term, trunc, info = envs.step(action.numpy())
        next_obs = nxt.copy()  # same-step autoreset: an ended episode's last obs is in info
        if "_final_obs" in info:
            next_obs[info["_final_obs"]] = np.stack(info["final_obs"][info["_final_obs"]])
        if "_episode" in info:
            returns.extend(info["episode"]["r"][info["_episode"]].tolist())
        rew = rew.astype(np.float32)
        step = (obs, action, pi.log_prob(action), value, rew, next_obs, term, term | trunc)
        for k, v in zip(keys, step):
            steps[k].append(torch.as_tensor(v))
        obs = torch.as_tensor(nxt)
    s = {k: torch.stack(v) for k, v in steps.items()}  # [T, E, ...]
    next_value = net(s["next_obs"])[1]  # a truncated episode bootstraps from its last obs
    delta = s["reward"] + GAMMA * next_value * ~s["term"] - s["value"]
    adv, carry = torch.zeros_like(delta), torch.zeros_like(delta[0])
    for t in reversed(range(args.num_steps)):  # GAE, cut at every episode end
        carry = delta[t] + GAMMA * LAM * ~s["end"][t] * carry
        adv[t] = carry
    items = {k: s[k].flatten(0, 1) for k in ("obs", "action", "logp", "value")}
    items.update(adv=adv.flatten(), ret=(adv + s["value"]).flatten())
    return items, obs


def update(learner, opt, batch):
    """Epochs x minibatches of clipped-surrogate updates on this learner's rollout share."""
    for _ in range(EPOCHS):
        for idx in torch.randperm(len(batch["adv"])).chunk(MINIBATCHES):
            mb = {k: v[idx] for k, v in batch.items()}
            logits, value = learner(mb["obs"])
            logps = F.log_softmax(logits, dim=-1)
            ratio = (logps.gather(1, mb["action"][:, None])[:, 0] - mb["logp"]).exp()
            adv = (mb["adv"] - mb["adv"].mean()) / (mb["adv"].std() + 1e-8)
            pg = torch.max(-adv * ratio, -adv * ratio.clamp(1 - CLIP, 1 + CLIP)).mean()
            v_clip = mb["value"] + (value - mb["value"]).clamp(-CLIP, CLIP)
            v_loss = 0.5 * torch.max((value - mb["ret"]) ** 2, (v_clip - mb["ret"]) ** 2).mean()
            entropy = -(logps.exp() * logps).sum(-1).mean()
            opt.zero_grad()
            (pg - ENT * entropy + VF * v_loss).backward()  # DDP averages over the learners
            nn.utils.clip_grad_norm_(learner.parameters(), 0.5)
            opt.step()


def hand_over(plane, net, version):
    """Disaggregated: the learner's round carries its new weights; actors run rounds until
    `pull_weights` returns them, so every rank leaves in the same round."""
    plane.flush()
    if not plane.is_learner:
        while plane.pull_weights(net) < version:
            plane.flush()


def run(plane, rank, world, learners):
    acting = not args.disaggregated or rank not in learners
    n_actors = world - len(learners) if args.disaggregated else world
    rollout = args.num_steps * args.num_envs * n_actors  # items per iteration, globally
    share, iters = rollout // len(learners), math.ceil(args.env_steps / rollout)
    net = ActorCritic()
    learner = nn.parallel.DistributedDataParallel(net) if len(learners) > 1 else net
    opt = torch.optim.Adam(net.parameters(), lr=LR, eps=1e-5)
    if acting:
        envs = gym.make_vec("CartPole-v1", args.num_envs, "sync", vector_kwargs=SAME_STEP)
        envs = gym.wrappers.vector.RecordEpisodeStatistics(envs)
        obs = torch.as_tensor(envs.reset(seed=args.seed + 1000 * rank)[0])
    returns, version, max_age = deque(maxlen=100), 0, 0
    if args.disaggregated:  # the actors' first weights
        version = plane.publish_weights(net) if plane.is_learner else 1
        hand_over(plane, net, version)
    for it in range(iters):
        if acting:  # items carry the version this rank last pulled or published
            items, obs = collect(envs, obs, net, returns)
            plane.put(items)
        if plane.is_learner:
            opt.param_groups[0]["lr"] = LR * (1 - it / iters)
            # wait_s: should an actor's rollout miss this round, run further rounds (actors
            # keep flushing until the new weights arrive) instead of raising EmptyStoreError.
            batch = plane.fetch(share, wait_s=60 if args.disaggregated else 0)
            max_age = max(max_age, int((version - batch.pop("_version")).max()))
            update(learner, opt, batch)
            version = plane.publish_weights(net)  # sent in the next round
        else:
            version += 1
        if args.disaggregated:
            hand_over(plane, net, version)
        if rank == world - n_actors and it % 20 == 0:  # the first acting rank
            mean = np.mean(list(returns) or [np.nan])
            print(f"env_steps {(it + 1) * rollout} return_100 {mean:.1f} policy version {version}")
    if acting:
        envs.close()
    return iters * rollout, list(returns)[-math.ceil(100 / n_actors) :], max_age


def main():
    cd.init_distributed()
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(args.seed + rank)
        learners = [0] if args.disaggregated else list(range(world))
        if args.disaggregated and world < 2:
            raise SystemExit("ppo_queue --disaggregated: needs at least 2 ranks, got 1")
        start = time.perf_counter()
        plane = cd.DataPlane(
            cd.ExperienceSpec(SPEC),
            capacity_per_rank=2 * args.num_steps * args.num_envs,
            seed=args.seed,
            sampler=cd.Fifo(),  # every item to exactly one learner, once, oldest first
            placement="local",
            learner_ranks=learners,
            schedule="sync",  # one fetch per rollout, right after the put: nothing to overlap
            max_policy_age=0,
        )
        try:
            env_steps, returns, max_age = run(plane, rank, world, learners)
        finally:
            plane.close()  # collective: every rank closes
        parts = [None] * world  # the last 100 episodes over all actors, the oldest item seen
        dist.all_gather_object(parts, (returns, max_age))
        recent = [r for p, _ in parts for r in p]
        if rank == 0:
            out = {"env_steps": env_steps, "return_100": float(np.mean(recent)) if recent else None}
            out["policy_age_max"] = max(a for _, a in parts)
            print(json.dumps({**out, "wall_s": round(time.perf_counter() - start, 1)}))
    finally:
        cd.destroy_distributed()


if __name__ == "__main__":
    main()
