"""``python -m conduit_dist.bench rllib``: a training step's buffer work behind RLlib's calls.

RLlib's own ``PrioritizedEpisodeReplayBuffer`` against the plane's
(``conduit_dist.integrations.rllib.ConduitPrioritizedEpisodeReplayBuffer``), side by side in one
process and one run, behind the same calls DQN makes each training step: ``add`` of the env
runner's new steps (``--add-steps`` per step, as episode chunks that continue across calls),
``sample(num_items=B, n_step=(2, 5), gamma=0.99, beta=0.4)`` and ``update_priorities`` of B
TD errors. Both buffers are filled to ``--capacity`` (50,000, the tuned CartPole example's) with
the same CartPole episodes first, so eviction runs in the timed steps (``--fill 0``: from empty,
no eviction, the first 50,000 steps of a run); the timed blocks
alternate between the two (``median_times``), so the machine's drift hits both alike. Batches
of 32 (the tuned example's) and 256. Beside them, what building ``B`` of RLlib's 1-step
``SingleAgentEpisode`` items from ready arrays costs alone, which any buffer behind these calls
does per sample: through RLlib's constructor (``floor_ms_b*``, as RLlib's buffer builds them)
and as the plane's buffer builds them (``items_ms_b*``: one through the constructor, the rest
copies of it with their own values, the cyclic collector paused meanwhile, so it holds both
effects; ``bound_speedup_b*``: RLlib's step over that).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from conduit_dist.bench.common import emit, median_times, number
from conduit_dist.extras import require


def _chunks(steps: int, size: int, seed: int) -> list:
    """CartPole episodes played at random, cut into chunks of ``size`` steps (an episode's
    chunks continue it, as an env runner's do), ``steps`` steps in all."""
    import gymnasium as gym
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    env = gym.make("CartPole-v1")
    rng = np.random.default_rng(seed)
    obs, info = env.reset(seed=seed)
    eps = SingleAgentEpisode(observation_space=env.observation_space, action_space=env.action_space)
    eps.add_env_reset(obs, info)
    out = []
    for _ in range(steps):
        a = int(rng.integers(2))
        obs, r, term, trunc, info = env.step(a)
        eps.add_env_step(obs, a, r, info, terminated=term, truncated=trunc)
        if term or trunc or len(eps) >= size:
            out.append(eps.to_numpy())
            if term or trunc:
                obs, info = env.reset()
                eps = SingleAgentEpisode(
                    observation_space=env.observation_space, action_space=env.action_space
                )
                eps.add_env_reset(obs, info)
            else:
                eps = eps.cut()
    return out


def _groups(chunks: list, size: int) -> list[list]:
    """Consecutive chunks holding ``size`` steps together: one training step's add."""
    out, cur, n = [], [], 0
    for c in chunks:
        cur.append(c)
        n += len(c)
        if n >= size:
            out.append(cur)
            cur, n = [], 0
    return out


class _Stepper:
    """One buffer's training steps: add the next steps, sample ``b``, update ``b`` priorities;
    the time of each call summed."""

    def __init__(self, buf, feed, b: int, rng, steps: int) -> None:
        self.buf, self.feed, self.b, self.rng, self.steps = buf, feed, b, rng, steps
        self.spent = {"add": 0.0, "sample": 0.0, "update": 0.0, "steps": 0}

    def step(self) -> None:
        try:
            chunk = next(self.feed)
        except StopIteration:
            raise SystemExit(f"--steps {self.steps}: ran out of env steps; pass more") from None
        b, s = self.b, self.spent
        t1 = time.perf_counter()
        self.buf.add(chunk)
        t2 = time.perf_counter()
        self.buf.sample(num_items=b, n_step=(2, 5), gamma=0.99, beta=0.4, sample_episodes=True)
        t3 = time.perf_counter()
        self.buf.update_priorities(np.abs(self.rng.normal(size=b)) + 0.01)
        t4 = time.perf_counter()
        s["add"] += t2 - t1
        s["sample"] += t3 - t2
        s["update"] += t4 - t3
        s["steps"] += 1


class _Floor:
    """Building ``b`` of RLlib's 1-step ``SingleAgentEpisode`` items (with the spaces, as both
    buffers pass them) from ready arrays, which any buffer behind these calls does per sample:
    through RLlib's constructor (``made="constructor"``, as RLlib's buffer builds them) or as
    the plane's buffer does (``"template"``: ``integrations.rllib._Items``)."""

    def __init__(self, b: int, chunk, made: str) -> None:
        from conduit_dist.integrations.rllib import _Items

        self.maker = _Items(chunk.observation_space, chunk.action_space)
        o = np.asarray(chunk.get_observations(slice(0, 2)))
        self.rows = [(o[0], o[1], i % 2, 1.0, False, False, 1.0, 2, i) for i in range(b)]
        self.made = made

    def step(self) -> None:
        if self.made == "template":
            self.maker.items(self.rows)
        else:
            for row in self.rows:
                self.maker._made(*row)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m conduit_dist.bench rllib", description=__doc__)
    p.add_argument("--capacity", type=number(int, 100), default=50_000)
    p.add_argument(
        "--fill", type=number(int, 0), default=None,
        help="env steps stored before the timed steps (default: --capacity, so adds evict)",
    )  # fmt: skip
    p.add_argument("--add-steps", type=number(int, 1), default=4)
    p.add_argument("--batches", type=number(int, 1), nargs="+", default=[32, 256])
    p.add_argument("--repeats", type=number(int, 1), default=5)
    p.add_argument("--min-time", type=number(float, 0, strict=True), default=0.3)
    p.add_argument("--steps", type=number(int, 1), default=60_000, help="timed env steps ready")
    a = p.parse_args(argv)
    with require("rllib", "python -m conduit_dist.bench rllib"):
        from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import (
            PrioritizedEpisodeReplayBuffer,
        )

        from conduit_dist.integrations.rllib import ConduitPrioritizedEpisodeReplayBuffer
    import torch

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    filled = a.capacity if a.fill is None else a.fill
    fill = _chunks(filled, 50, seed=0) if filled else []
    steps = _groups(_chunks(a.steps, a.add_steps, seed=1), a.add_steps)
    made_s = time.perf_counter() - t0
    results, summary = [], {}
    for b in a.batches:
        buffers = {
            "rllib": PrioritizedEpisodeReplayBuffer(capacity=a.capacity, alpha=0.6),
            "conduit": ConduitPrioritizedEpisodeReplayBuffer(
                capacity=a.capacity, alpha=0.6, n_step=(2, 5)
            ),
        }
        rng = np.random.default_rng(2)
        steppers = {k: _Stepper(buf, iter(steps), b, rng, a.steps) for k, buf in buffers.items()}
        for buf in buffers.values():
            if fill:
                buf.add(fill)

        fns = {k: st.step for k, st in steppers.items()}
        for made in ("constructor", "template"):
            fns[made] = _Floor(b, steps[0][0], made).step
        times = median_times(fns, min_time=a.min_time, repeats=a.repeats)
        floor, items = times.pop("constructor"), times.pop("template")
        for name, sec in times.items():
            s = steppers[name].spent
            results.append({
                "buffer": name, "batch": b, "step_ms": sec * 1e3,
                **{f"{k}_ms": s[k] / s["steps"] * 1e3 for k in ("add", "sample", "update")},
                "steps_timed": s["steps"],
            })  # fmt: skip
        summary[f"speedup_b{b}"] = times["rllib"] / times["conduit"]
        # what building the items costs alone: through RLlib's constructor (what RLlib's
        # buffer pays), and as the plane's buffer builds them; RLlib's step over the latter is
        # the most a buffer building its items that way could gain
        summary[f"floor_ms_b{b}"] = floor * 1e3
        summary[f"items_ms_b{b}"] = items * 1e3
        summary[f"bound_speedup_b{b}"] = times["rllib"] / items
        print(
            f"batch {b}: rllib {times['rllib'] * 1e3:.3f} ms, conduit "
            f"{times['conduit'] * 1e3:.3f} ms per training step",
            flush=True,
        )
        del buffers
    emit(
        "rllib", results, summary, capacity=a.capacity, filled=filled, add_steps=a.add_steps,
        n_step=[2, 5], alpha=0.6, beta=0.4, episodes_made_s=made_s,
    )  # fmt: skip


if __name__ == "__main__":
    main()
