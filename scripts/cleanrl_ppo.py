"""CleanRL-style single-process PPO on CartPole: the baseline for ``experiment=cartpole_ppo``.

python scripts/cleanrl_ppo.py --seed 0 [--total-env-steps 500000]

One file in CleanRL's ``ppo.py`` manner (written for this project, same hyperparameters as
``conf/algo/ppo.yaml``): 4 envs, 128 steps, 4 epochs of 4 minibatches, lr 2.5e-4 annealed,
GAE 0.95, clip 0.2, entropy 0.01, value 0.5 (clipped), grad norm 0.5, 64x64 tanh networks. The
rollout lives in preallocated tensors and minibatches are index slices of a permutation: no
data plane. The networks, GAE and loss are the project's own (``conduit_dist.rl.ppo``), so the
comparison times the loop around them; like the trainer, GAE bootstraps a truncated episode from
its final observation's value (CleanRL treats truncation as termination). Prints a JSON line
last: wall time, env steps, the last-100 mean return.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque

import gymnasium as gym
import numpy as np
import torch
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from torch import nn

from conduit_dist.rl.ppo import ActorCritic, gae, ppo_loss


def main() -> None:
    """Train and print the JSON summary."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--total-env-steps", type=int, default=500_000)
    ap.add_argument("--num-envs", type=int, default=4)
    ap.add_argument("--num-steps", type=int, default=128)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(args.seed)
    lr, gamma, lam, clip, ent, vf, epochs, mbs = 2.5e-4, 0.99, 0.95, 0.2, 0.01, 0.5, 4, 4
    n, t_len = args.num_envs, args.num_steps
    envs = SyncVectorEnv(
        [lambda: gym.make("CartPole-v1") for _ in range(n)], autoreset_mode=AutoresetMode.SAME_STEP
    )
    net = ActorCritic(4, 2, [64, 64])
    opt = torch.optim.Adam(net.parameters(), lr=lr, eps=1e-5)
    obs = torch.as_tensor(envs.reset(seed=args.seed)[0], dtype=torch.float32)
    buf = {k: torch.zeros(t_len, n) for k in ("logp", "value", "reward", "next_value")}
    buf_obs, buf_act = torch.zeros(t_len, n, 4), torch.zeros(t_len, n, dtype=torch.int64)
    buf_next = torch.zeros(t_len, n, 4)
    term_b, end_b = torch.zeros(t_len, n, dtype=torch.bool), torch.zeros(t_len, n, dtype=torch.bool)
    returns, ep_ret = deque(maxlen=100), np.zeros(n)
    iters = -(-args.total_env_steps // (n * t_len))
    start = time.perf_counter()
    for it in range(iters):
        opt.param_groups[0]["lr"] = (1 - it / iters) * lr
        for t in range(t_len):
            with torch.no_grad():
                logits, value = net(obs)
                probs = torch.softmax(logits, -1)
                action = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            o, r, term, trunc, info = envs.step(action.numpy())
            nxt = o.copy()
            if "_final_obs" in info:
                for i in np.nonzero(info["_final_obs"])[0]:
                    nxt[i] = info["final_obs"][i]
            buf_obs[t], buf_act[t] = obs, action
            buf_next[t] = torch.as_tensor(nxt, dtype=torch.float32)
            buf["logp"][t] = torch.log(probs.gather(1, action[:, None]).squeeze(1))
            buf["value"][t], buf["reward"][t] = value, torch.as_tensor(r)
            term_b[t], end_b[t] = torch.as_tensor(term), torch.as_tensor(term | trunc)
            ep_ret += r
            for i in np.nonzero(term | trunc)[0]:
                returns.append(ep_ret[i])
                ep_ret[i] = 0
            obs = torch.as_tensor(o, dtype=torch.float32)
        with torch.no_grad():  # the next observations' values, one batched forward
            buf["next_value"] = net(buf_next.reshape(-1, 4))[1].view(t_len, n)
        adv, ret = gae(buf["reward"], buf["value"], buf["next_value"], term_b, end_b, gamma, lam)
        b_obs, b_act = buf_obs.reshape(-1, 4), buf_act.reshape(-1)
        b_logp, b_adv, b_ret = buf["logp"].reshape(-1), adv.reshape(-1), ret.reshape(-1)
        b_val, size = buf["value"].reshape(-1), n * t_len
        for _ in range(epochs):
            perm = torch.randperm(size, generator=gen)
            for mb in perm.split(size // mbs):
                logits, value = net(b_obs[mb])
                old = {"action": b_act[mb], "logp": b_logp[mb], "adv": b_adv[mb]}
                old.update(ret=b_ret[mb], value=b_val[mb])
                loss, _ = ppo_loss(logits, value, old, clip, ent, vf)
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(net.parameters(), 0.5)
                opt.step()
    wall = time.perf_counter() - start
    print(json.dumps({
        "baseline": "cleanrl_style_ppo", "seed": args.seed, "env_steps": iters * n * t_len,
        "wall_s": round(wall, 1), "return_100": float(np.mean(returns)) if returns else None,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
