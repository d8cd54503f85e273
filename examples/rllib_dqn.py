"""RLlib's tuned CartPole DQN (rllib/tuned_examples/dqn/cartpole_dqn.py's settings), with the
replay buffer swapped by configuration: RLlib's own ``PrioritizedEpisodeReplayBuffer`` or the
plane's (``conduit_dist.integrations.rllib``). Nothing else of RLlib changes.

    python examples/rllib_dqn.py --buffer conduit --seed 0
    python examples/rllib_dqn.py --buffer rllib --seed 0

It trains until the mean return over RLlib's smoothing window (100 episodes) reaches
``--stop-reward`` (450, the tuned example's) or ``--env-steps`` env steps (200,000) pass,
and prints one JSON line last: the buffer, the seed, the env steps at which the target was first
reached (``null``: not reached), the best mean return and the buffer's time per training step.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def config_for(buffer: str, seed: int, num_learners: int = 0):
    """The tuned example's DQNConfig with ``buffer`` (``"conduit"``, ``"conduit-uniform"`` or
    ``"rllib"``) as its replay buffer."""
    from ray.rllib.algorithms.dqn import DQNConfig
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    from conduit_dist.integrations.rllib import PRIORITIZED, UNIFORM

    n_step = (2, 5)
    replay = {"capacity": 50_000, "alpha": 0.6, "beta": 0.4}
    if buffer == "rllib":
        replay["type"] = "PrioritizedEpisodeReplayBuffer"
    elif buffer in ("conduit", "conduit-uniform"):
        replay.update(
            type=PRIORITIZED if buffer == "conduit" else UNIFORM, n_step=n_step, seed=seed
        )
    else:
        raise SystemExit(f"--buffer: expected conduit, conduit-uniform or rllib, got {buffer!r}")
    return (
        DQNConfig()
        .environment("CartPole-v1")
        .training(
            lr=0.0005,
            train_batch_size_per_learner=32,
            replay_buffer_config=replay,
            n_step=n_step,
            double_q=True,
            dueling=True,
            epsilon=[(0, 1.0), (10000, 0.02)],
        )
        .rl_module(
            model_config=DefaultModelConfig(
                fcnet_hiddens=[256],
                fcnet_activation="tanh",
                fcnet_bias_initializer="zeros_",
                head_fcnet_bias_initializer="zeros_",
                head_fcnet_hiddens=[256],
            )
        )
        .learners(num_learners=num_learners)
        .debugging(seed=seed)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--buffer", default="conduit")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop-reward", type=float, default=450.0)
    ap.add_argument("--env-steps", type=int, default=200_000)
    ap.add_argument("--num-learners", type=int, default=0)
    args = ap.parse_args()
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    import ray

    ray.init(num_cpus=max(1, args.num_learners + 1), include_dashboard=False, log_to_driver=False)
    algo = config_for(args.buffer, args.seed, args.num_learners).build_algo()
    reached, best, steps, t0 = None, float("-inf"), 0, time.time()
    timers: dict[str, float] = {}
    while steps < args.env_steps:
        r = algo.train()
        env = r["env_runners"]
        steps = int(env.get("num_env_steps_sampled_lifetime", 0))
        ret = env.get("episode_return_mean")
        if ret is not None:
            best = max(best, float(ret))
            print(f"steps {steps} return_mean {ret:.1f}", flush=True)
            if ret >= args.stop_reward:
                reached = steps
                break
        timers = r.get("timers", {})
    buffer_s = sum(
        timers.get(k, 0.0)
        for k in ("replay_buffer_add_data_timer", "replay_buffer_sampling_timer",
                  "replay_buffer_update_prios_timer")
    )  # fmt: skip
    algo.stop()
    ray.shutdown()
    print(json.dumps({
        "buffer": args.buffer, "seed": args.seed, "steps_to_target": reached,
        "target": args.stop_reward, "best_return_mean": best, "env_steps": steps,
        "wall_s": round(time.time() - t0, 1), "buffer_s_per_training_step": buffer_s,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
