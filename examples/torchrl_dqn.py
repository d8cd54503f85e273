# python examples/torchrl_dqn.py
# torchrun --standalone --nproc_per_node=2 examples/torchrl_dqn.py
"""DQN on CartPole written against TorchRL's public API, learning through conduit_dist.

Needs the extras: ``pip install -e ".[train,torchrl]"`` (gymnasium; torchrl 0.14.1, tensordict
0.14.3).

The structure follows TorchRL's sota-implementations/dqn/dqn_cartpole.py (RewardSum and
StepCounter transforms, a QValueActor over an MLP [120, 84], EGreedyModule, Collector (0.14's
name for SyncDataCollector), DQNLoss, a target updater, Adam). The one replaced line is the
replay buffer's construction (marked below). What runs it on several ranks is added, as a DDP
script adds it: the process group, each rank's own collector (seeded by rank) with its share of
the frames and envs, the gradient average after backward, and the episode returns gathered
for the report. The env is TorchRL's GymWrapper over 8 CartPoles stepped in this process
(gymnasium's sync vector env; GymEnv(num_envs=) would start subprocesses): ~10x fewer policy
calls per frame than TorchRL's single env.

Hyperparameters (global, whatever the world size; TorchRL's cartpole config, sized for 500k
frames, in brackets): 8 envs [1], 32 frames per batch [1000] and 8 updates after each [100],
batch 128 [128], buffer 50k [10k], Adam lr 1e-3 [2.5e-4], gamma 0.99 [0.99], epsilon 1 -> 0.05
over 10k frames [250k], 1k random frames first [10k], soft target update tau 0.01 per update
[hard, every 50 updates], l2 loss [l2]. On ``w`` ranks each collects ``1/w`` of the frames and
samples ``1/w`` of the batch. ``--set key=value`` overrides a CFG entry (smooth_l1 + double DQN
+ grad-norm 10 + tau 0.005 was tried and did worse: seed 0 never reached 200 in 60k).
Prints one JSON line at the end: env_steps, last50 (mean return of the last 50 training
episodes over all ranks), reached (last50 >= --target at some point), reached_at, wall_s.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

import conduit_dist as cd
from conduit_dist.extras import require

with require("train", "examples/torchrl_dqn.py"):  # pip install -e ".[train,torchrl]"
    import gymnasium as gym
with require("torchrl", "examples/torchrl_dqn.py"):
    from tensordict.nn import TensorDictSequential
    from torchrl.collectors import Collector
    from torchrl.data import Composite
    from torchrl.envs import GymWrapper, RewardSum, StepCounter, TransformedEnv
    from torchrl.modules import MLP, EGreedyModule, QValueActor
    from torchrl.objectives import DQNLoss, SoftUpdate

    from conduit_dist.integrations.torchrl import ShardedReplayBuffer

CFG = dict(
    num_envs=8, frames_per_batch=32, num_updates=8, batch_size=128, buffer_size=50_000, lr=1e-3,
    gamma=0.99, eps_start=1.0, eps_end=0.05, annealing_frames=10_000, init_random_frames=1_000,
    tau=0.01, loss_function="l2", double_dqn=False, max_grad_norm=0.0,
)  # fmt: skip


def make_env(num_envs: int, env_name: str = "CartPole-v1") -> TransformedEnv:
    """TorchRL's make_env over ``num_envs`` copies stepped in this process (GymEnv(num_envs=)
    would start one subprocess per copy)."""
    vec = gym.make_vec(
        env_name, num_envs=num_envs, vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
    )  # fmt: skip
    env = TransformedEnv(GymWrapper(vec))
    env.append_transform(RewardSum())
    env.append_transform(StepCounter())
    return env


def make_dqn_model(env: TransformedEnv) -> QValueActor:
    action_spec = env.full_action_spec_unbatched["action"]
    mlp = MLP(
        in_features=env.observation_spec_unbatched["observation"].shape[-1],
        activation_class=torch.nn.ReLU,
        out_features=action_spec.space.n,
        num_cells=[120, 84],
    )
    return QValueActor(module=mlp, spec=Composite(action=action_spec), in_keys=["observation"])


def average_gradients(params: list[torch.nn.Parameter], world: int) -> None:
    """The mean of every rank's gradients, in one all_reduce (a no-op on one rank)."""
    if world == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    at = 0
    for g in grads:
        g.copy_(flat[at : at + g.numel()].view_as(g))
        at += g.numel()


def first_crossing(history: list[tuple[int, int, float]], target: float) -> int | None:
    """Global env steps at which the mean of the last 50 episodes first reached ``target``."""
    returns = [r for _, _, r in history]
    for i in range(50, len(returns) + 1):
        if sum(returns[i - 50 : i]) / 50 >= target:
            return history[i - 1][0]
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-frames", "--env-steps", type=int, default=60_000, help="global")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sampler", choices=["uniform", "prioritized"], default="uniform")
    ap.add_argument("--log-every", type=int, default=4_000, help="global env steps")
    ap.add_argument("--target", type=float, default=200.0, help="last-50 mean return")
    ap.add_argument("--init-random-frames", type=int, default=CFG["init_random_frames"])
    ap.add_argument("--stop-at-target", action="store_true", help="stop once it is reached")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="CFG entry")
    args = ap.parse_args()
    for item in args.set:
        key, value = item.split("=", 1)
        if key not in CFG:
            raise SystemExit(f"--set {item}: unknown key {key!r} (CFG has {sorted(CFG)})")
        CFG[key] = type(CFG[key])(value) if not isinstance(CFG[key], bool) else value == "true"
    t0 = time.monotonic()
    torch.set_num_threads(1)
    cd.init_distributed()
    rank, world = cd.get_rank(), cd.get_world_size()
    if any(CFG[k] % world for k in ("num_envs", "frames_per_batch", "batch_size")):
        raise SystemExit(f"world size {world} must divide num_envs, frames_per_batch, batch_size")

    torch.manual_seed(args.seed)  # the same initial network on every rank
    envs = CFG["num_envs"] // world
    model = make_dqn_model(make_env(envs))
    torch.manual_seed(args.seed * 1000 + rank)  # each rank explores on its own
    greedy_module = EGreedyModule(
        annealing_num_steps=CFG["annealing_frames"] // world,
        eps_init=CFG["eps_start"],
        eps_end=CFG["eps_end"],
        spec=model.spec,
    )
    model_explore = TensorDictSequential(model, greedy_module)

    sampler = cd.Prioritized(alpha=0.6, beta=0.4) if args.sampler == "prioritized" else "uniform"
    # TorchRL: replay_buffer = TensorDictReplayBuffer(pin_memory=False,
    #     storage=LazyTensorStorage(max_size=CFG["buffer_size"]), batch_size=CFG["batch_size"])
    replay_buffer = ShardedReplayBuffer(
        CFG["buffer_size"] // world, batch_size=CFG["batch_size"] // world, sampler=sampler
    )

    loss_module = DQNLoss(
        value_network=model, loss_function=CFG["loss_function"], delay_value=True,
        double_dqn=CFG["double_dqn"],
    )  # fmt: skip
    loss_module.make_value_estimator(gamma=CFG["gamma"])
    target_net_updater = SoftUpdate(loss_module, tau=CFG["tau"])
    optimizer = torch.optim.Adam(loss_module.parameters(), lr=CFG["lr"])
    params = [p for p in loss_module.parameters() if p.requires_grad]

    def update(sampled_tensordict):
        loss_td = loss_module(sampled_tensordict)
        q_loss = loss_td["loss"]
        optimizer.zero_grad()
        q_loss.backward()
        average_gradients(params, world)
        if CFG["max_grad_norm"]:
            torch.nn.utils.clip_grad_norm_(params, CFG["max_grad_norm"])
        optimizer.step()
        target_net_updater.step()
        return q_loss.detach()

    collector = Collector(
        create_env_fn=lambda: make_env(envs),
        policy=model_explore,
        frames_per_batch=CFG["frames_per_batch"] // world,
        total_frames=args.total_frames // world,
        device="cpu",
        storing_device="cpu",
        max_frames_per_traj=-1,
        init_random_frames=args.init_random_frames // world,
    )
    collector.set_seed(args.seed * 1000 + rank)

    collected_frames, next_log, q_loss = 0, args.log_every, float("nan")
    mine: list[tuple[int, int, float]] = []  # (global frames, rank, return) since the last gather
    history: list[tuple[int, int, float]] = []  # every rank's episodes, in the same order
    reached_at = None
    for data in collector:
        data = data.reshape(-1)
        replay_buffer.extend(data)
        collected_frames += data.numel() * world
        greedy_module.step(data.numel())
        episode_rewards = data["next", "episode_reward"][data["next", "done"]]
        mine += [(collected_frames, rank, float(r)) for r in episode_rewards]

        if collected_frames >= args.init_random_frames:
            for _ in range(CFG["num_updates"]):
                sampled_tensordict = replay_buffer.sample()
                q_loss = update(sampled_tensordict).item()
                if args.sampler == "prioritized":
                    replay_buffer.update_tensordict_priority(sampled_tensordict)
        collector.update_policy_weights_()

        last = collected_frames >= args.total_frames // world * world
        if collected_frames >= next_log or last:
            next_log += args.log_every
            gathered = [mine]
            if world > 1:
                gathered = [None] * world
                dist.all_gather_object(gathered, mine)
            history = sorted(history + [e for part in gathered for e in part])
            mine = []
            reached_at = first_crossing(history, args.target)
            last50 = sum(r for _, _, r in history[-50:]) / max(1, len(history[-50:]))
            if rank == 0:
                print(
                    f"frames {collected_frames:6d}  episodes {len(history):4d}  last50 "
                    f"{last50:6.1f}  eps {greedy_module.eps.item():.3f}  q_loss {q_loss:.3f}  "
                    f"len(rb) {len(replay_buffer)}  {time.monotonic() - t0:5.0f}s",
                    flush=True,
                )
            if reached_at is not None and args.stop_at_target:
                break

    collector.shutdown()
    replay_buffer.close()
    last50 = sum(r for _, _, r in history[-50:]) / max(1, len(history[-50:]))
    if rank == 0:
        result = {
            "env_steps": collected_frames,
            "last50": round(last50, 1),
            "reached": reached_at is not None,
            "reached_at": reached_at,
            "episodes": len(history),
            "world": world,
            "seed": args.seed,
            "sampler": args.sampler,
            "wall_s": round(time.monotonic() - t0, 1),
        }
        print(json.dumps(result), flush=True)
    cd.destroy_distributed()


if __name__ == "__main__":
    main()
