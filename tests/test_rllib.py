"""The plane behind RLlib's replay buffer calls (``conduit_dist.integrations.rllib``): draws exact
(chi-square over (episode, step, n) with priorities set), n-step items as RLlib builds them,
importance weights, state through ``get_state``/``set_state`` and ``torch.load(weights_only=True)``,
clear errors, and RLlib's DQN running with the buffer selected by configuration."""

from __future__ import annotations

import gc
import io
import uuid

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import conduit_dist as cd

rllib = pytest.importorskip("ray.rllib", reason="needs the [rllib] extra (scripts/run_tests.sh)")
from gymnasium.spaces import Box, Discrete  # noqa: E402
from ray.rllib.env.single_agent_episode import SingleAgentEpisode  # noqa: E402

from conduit_dist.integrations.rllib import (  # noqa: E402
    PRIORITIZED,
    ConduitEpisodeReplayBuffer,
    ConduitPrioritizedEpisodeReplayBuffer,
)

GAMMA = 0.9
OBS = Box(-1e6, 1e6, (3,), np.float32)


def episode(eid: int, n: int, end: str, start: int = 0, chunk_of=None) -> SingleAgentEpisode:
    """An episode (or a continuing chunk of ``chunk_of``) whose step ``t`` observes
    ``[eid, t, 0]``, acts ``(eid + t) % 2`` and is rewarded ``eid + t / 100``."""
    eps = chunk_of.cut() if chunk_of is not None else SingleAgentEpisode(
        observation_space=OBS, action_space=Discrete(2)
    )  # fmt: skip
    if chunk_of is None:
        eps.add_env_reset(np.array([eid, start, 0], np.float32), {})
    for t in range(start, start + n):
        last = t == start + n - 1
        eps.add_env_step(
            np.array([eid, t + 1, 0], np.float32), (eid + t) % 2, eid + t / 100, {},
            terminated=last and end == "terminated", truncated=last and end == "truncated",
        )  # fmt: skip
    return eps.to_numpy()


def store(buffer) -> dict[int, tuple[int, str]]:
    """Three ended episodes (5 steps terminated, 7 truncated, 9 terminated in two chunks) and an
    ongoing one (6 steps so far): returns each episode's (length, end)."""
    first = episode(2, 4, "")
    buffer.add([episode(0, 5, "terminated"), episode(1, 7, "truncated"), first])
    buffer.add([episode(2, 5, "terminated", 4, first), episode(3, 6, "")])
    return {0: (5, "terminated"), 1: (7, "truncated"), 2: (9, "terminated"), 3: (6, "")}


def priority(eid: int, t: int) -> float:
    return 0.5 + (3 * eid + t) % 4


def starts(lengths, max_n: int) -> list[tuple[int, int]]:
    """The steps the plane can draw: every step of an ended episode (its padding completes the
    window), and the ongoing episode's steps whose ``max_n`` window is in."""
    out = []
    for eid, (n, end) in lengths.items():
        last = n if end else n - max_n + 1
        out += [(eid, t) for t in range(last)]
    return out


def check_item(item, eid: int, t: int, n: int, lengths) -> None:
    """The 1-step episode RLlib's buffer would build for (eid, t, n)."""
    length, end = lengths[eid]
    obs = item.get_observations()
    np.testing.assert_array_equal(obs[0], [eid, t, 0])
    np.testing.assert_array_equal(obs[1], [eid, t + n, 0])
    assert item.get_actions()[0] == (eid + t) % 2
    want = sum(GAMMA**k * (eid + (t + k) / 100) for k in range(n))
    assert item.get_rewards()[0] == pytest.approx(want, rel=1e-6)
    at_end = t + n == length
    assert item.is_terminated == (at_end and end == "terminated")
    assert item.is_truncated == (at_end and end == "truncated")
    assert item.t_started == t


def draws(buffer, rounds: int, size: int, n_step, beta: float = 0.0):
    got = []
    for _ in range(rounds):
        for item in buffer.sample(num_items=size, n_step=n_step, gamma=GAMMA, beta=beta):
            obs = item.get_observations()[0]
            n = item.get_extra_model_outputs("n_step")[0]
            got.append(
                (int(obs[0]), int(obs[1]), int(n), item.get_extra_model_outputs("weights")[0], item)
            )
    return got


@pytest.mark.parametrize("alpha", [0.0, 0.7])
def test_draws_are_exact_over_steps_and_n_as_rllibs_buffers_end_episodes(alpha):
    kind = ConduitPrioritizedEpisodeReplayBuffer if alpha else ConduitEpisodeReplayBuffer
    kw = {"alpha": alpha} if alpha else {}
    buffer = kind(capacity=1000, n_step=(2, 5), seed=3, eps=0.0, **kw)
    lengths = store(buffer)
    valid = starts(lengths, 4)
    # with n >= 2 an episode's last step is always rejected: it is drawn, never returned
    accepted = {(e, t) for e, t in valid if t + 2 <= lengths[e][0]}
    if alpha:  # every step gets its priority: sample and update until all were returned
        seen = set()
        for _ in range(200):
            items = buffer.sample(num_items=64, n_step=(2, 5), gamma=GAMMA, beta=0.5)
            keys = [tuple(int(v) for v in it.get_observations()[0][:2]) for it in items]
            buffer.update_priorities(np.array([priority(*k) for k in keys]))
            seen |= set(keys)
            if seen == accepted:
                break
        assert seen == accepted
    got = draws(buffer, 40, 500, (2, 5), beta=0.5)
    counts: dict[tuple[int, int, int], int] = {}
    for eid, t, n, _, item in got[:300]:
        check_item(item, eid, t, n, lengths)
    for eid, t, n, _, _ in got:
        counts[(eid, t, n)] = counts.get((eid, t, n), 0) + 1
    # prioritized: a draw whose n steps run past its episode's end is drawn again (RLlib's
    # prioritized buffer); uniform: n is cut at the episode's end (RLlib's uniform buffer)
    mass: dict[tuple[int, int, int], float] = {}
    for e, t in valid:
        m = priority(e, t) ** alpha if alpha else 1.0
        for n in (2, 3, 4):
            left = lengths[e][0] - t
            if alpha and n > left:
                continue
            cell = (e, t, min(n, left))
            mass[cell] = mass.get(cell, 0.0) + m / 3
    cells = sorted(mass)
    assert set(counts) <= set(cells)  # never past an episode's end, never a padding row
    total = sum(mass.values())
    expected = np.array([len(got) * mass[c] / total for c in cells])
    observed = np.array([counts.get(c, 0) for c in cells])
    assert chisquare(observed, expected).pvalue > 1e-4
    if alpha:  # importance weights: (m_i / m_min) ** -beta, m over the drawable steps
        low = min(priority(e, t) ** alpha for e, t in valid)
        for eid, t, _, w, _ in got[:200]:
            assert w == pytest.approx((priority(eid, t) ** alpha / low) ** -0.5, rel=1e-5)
    else:
        assert all(w == 1.0 for *_, w, _ in got)


def test_a_fixed_n_step_and_one_step_items():
    buffer = ConduitPrioritizedEpisodeReplayBuffer(capacity=500, alpha=0.5, n_step=3, seed=1)
    lengths = store(buffer)
    for eid, t, n, _, item in draws(buffer, 5, 64, 3):
        assert n == 3 and t + 3 <= lengths[eid][0]
        check_item(item, eid, t, 3, lengths)
    one = ConduitEpisodeReplayBuffer(capacity=500, seed=1)  # n_step=1: no padding
    lengths = store(one)
    got = draws(one, 5, 64, None)
    assert {(e, t) for e, t, *_ in got} <= set(starts(lengths, 1))
    for eid, t, n, _, item in got:
        assert n == 1
        check_item(item, eid, t, 1, lengths)


def test_items_equal_rllibs_constructor_slot_by_slot_and_are_independent(monkeypatch):
    """Items are built from a template (``_Items``): each must equal what RLlib's constructor
    gives for the same values, in every slot, with ids of their own and nothing shared that a
    learner could mutate."""
    buffer = ConduitPrioritizedEpisodeReplayBuffer(capacity=500, alpha=0.5, n_step=(2, 4), seed=3)
    store(buffer)
    assert buffer._rows.maker.fast  # the pinned RLlib's episode: the template path runs
    items = buffer.sample(num_items=40, n_step=(2, 4), gamma=GAMMA, beta=0.4)
    assert len({item.id_ for item in items}) == 40
    for item in items:
        item.validate()
        want = SingleAgentEpisode(
            observations=list(item.get_observations()), observation_space=OBS,
            actions=list(item.get_actions()), action_space=Discrete(2),
            rewards=list(item.get_rewards()), terminated=item.is_terminated,
            truncated=item.is_truncated, len_lookback_buffer=0, t_started=item.t_started,
            extra_model_outputs={k: list(item.get_extra_model_outputs(k))
                                 for k in ("weights", "n_step")},
        )  # fmt: skip
        for slot in SingleAgentEpisode.__slots__:
            if slot != "id_":
                assert getattr(item, slot) == getattr(want, slot), slot
    a, b = items[1], items[2]
    a.extra_model_outputs["weights"].data.append(9.0)
    a.get_infos()[0]["x"] = 1
    a.custom_data["y"] = 2
    assert len(b.extra_model_outputs["weights"].data) == 1 and b.get_infos()[0] == {}
    assert b.custom_data == {}
    # ids stay unique where the constructor's uuid4 ends as a copy's counter would
    monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID("0123456789abcdef0123456700000001"))
    again = buffer.sample(num_items=16, n_step=(2, 4), gamma=GAMMA, beta=0.4)
    assert len({item.id_ for item in again}) == 16
    monkeypatch.undo()
    # the collector, paused while the items are built, is left as it was found
    assert gc.isenabled()
    buffer.sample(num_items=8, n_step=(2, 4), gamma=GAMMA, beta=0.4)
    assert gc.isenabled()
    gc.disable()
    try:
        buffer.sample(num_items=8, n_step=(2, 4), gamma=GAMMA, beta=0.4)
        assert not gc.isenabled()
    finally:
        gc.enable()
    # an RLlib without the slots the template path knows: the constructor builds every item
    slow = buffer._rows.maker
    slow.fast = False
    again = buffer.sample(num_items=8, n_step=(2, 4), gamma=GAMMA, beta=0.4)
    assert len(again) == 8 and all(isinstance(x, SingleAgentEpisode) for x in again)


def test_state_round_trips_through_torch_load_weights_only_and_draws_resume_alike():
    a = ConduitPrioritizedEpisodeReplayBuffer(capacity=500, alpha=0.6, n_step=(2, 5), seed=5)
    store(a)
    items = a.sample(num_items=16, n_step=(2, 5), gamma=GAMMA, beta=0.4)
    a.update_priorities(np.linspace(0.1, 3.0, len(items)))
    a.add([episode(7, 4, "terminated")])  # staged since the last round: the state stores it
    raw = io.BytesIO()
    torch.save(a.get_state(), raw)
    raw.seek(0)
    state = torch.load(raw, weights_only=True)
    b = ConduitPrioritizedEpisodeReplayBuffer(capacity=500, alpha=0.6, n_step=(2, 5), seed=5)
    b.set_state(state)
    assert len(b) == len(a)
    for _ in range(3):
        got = [draws(x, 1, 32, (2, 5), beta=0.4) for x in (a, b)]
        assert [g[:4] for g in got[0]] == [g[:4] for g in got[1]]
        for x in (a, b):
            x.update_priorities(np.arange(1, 33, dtype=np.float64))
    other = ConduitPrioritizedEpisodeReplayBuffer(capacity=500, alpha=0.6, n_step=3)
    with pytest.raises(cd.ConfigError, match="the state's max_n is 4, this buffer's 3"):
        other.set_state(state)
    with pytest.raises(cd.ConfigError, match="expected a conduit buffer's state"):
        other.set_state({"episodes": []})


def test_bad_input_is_refused_by_name_and_nothing_is_stored():
    buffer = ConduitPrioritizedEpisodeReplayBuffer(capacity=500, alpha=0.6, n_step=(2, 5))
    with pytest.raises(cd.EmptyStoreError):
        buffer.sample(num_items=4, n_step=2)
    store(buffer)
    before = len(buffer)
    odd = SingleAgentEpisode()
    odd.add_env_reset(np.zeros(5, np.float32), {})
    odd.add_env_step(np.zeros(5, np.float32), 1, 1.0, {}, terminated=True)
    with pytest.raises(
        cd.SpecError, match=r"'obs': \(\(\(3,\), 'float32'\), \(\(5,\), 'float32'\)\)"
    ):
        buffer.add([episode(8, 3, "terminated"), odd.to_numpy()])
    assert len(buffer) == before  # the good episode of that call was not stored either
    with pytest.raises(cd.ConfigError, match=r"needs windows of 5 steps, the buffer keeps 4"):
        buffer.sample(num_items=4, n_step=(2, 6))
    with pytest.raises(cd.ConfigError, match="batch_length_T=8: expected 1"):
        buffer.sample(num_items=4, n_step=2, batch_length_T=8)
    buffer.sample(num_items=4, n_step=2)
    with pytest.raises(cd.SpecError, match="expected 4 priorities .* got 3"):
        buffer.update_priorities(np.ones(3))
    with pytest.raises(cd.SpecError, match="expected finite priorities >= 0, got -1.0 at item 2"):
        buffer.update_priorities(np.array([1.0, 1.0, -1.0, 1.0]))
    with pytest.raises(cd.SpecError, match="expected SingleAgentEpisode chunks, got dict"):
        buffer.add([episode(8, 3, "terminated"), {"obs": 1}])
    assert len(buffer) == before
    with pytest.raises(cd.SpecError, match=r"add\(weight=0.5\): expected None"):
        buffer.add([episode(9, 3, "terminated")], weight=0.5)
    short = ConduitPrioritizedEpisodeReplayBuffer(capacity=100, alpha=0.6, n_step=5)
    short.add([episode(0, 2, "terminated"), episode(1, 3, "terminated")])
    with pytest.raises(cd.EmptyStoreError, match="episodes are shorter than n_step"):
        short.sample(num_items=4, n_step=5)
    for bad, match in (
        ({"capacity": 0}, r"\['capacity'\]: expected an int >= 1, got 0"),
        ({"n_step": (3, 3)}, r"\['n_step'\]: expected a range \(lo, hi\)"),
        ({"alpha": -1}, r"\['alpha'\]: expected a number >= 0, got -1"),
    ):
        with pytest.raises(cd.ConfigError, match=match):
            ConduitPrioritizedEpisodeReplayBuffer(**{"capacity": 10, **bad})


def test_rllibs_dqn_trains_with_the_buffer_selected_by_configuration():
    import ray
    from ray.rllib.algorithms.dqn import DQNConfig

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        config = (
            DQNConfig()
            .environment("CartPole-v1")
            .training(
                replay_buffer_config={
                    "type": PRIORITIZED,
                    "capacity": 2000,
                    "alpha": 0.6,
                    "beta": 0.4,
                    "n_step": (2, 5),
                },
                n_step=(2, 5),
                num_steps_sampled_before_learning_starts=200,
                train_batch_size_per_learner=32,
            )
            .reporting(min_sample_timesteps_per_iteration=300)
            .debugging(seed=0)
        )
        algo = config.build_algo()
        for _ in range(2):
            result = algo.train()
        buffer = algo.local_replay_buffer
        assert isinstance(buffer, ConduitPrioritizedEpisodeReplayBuffer)
        assert len(buffer) >= 500 and buffer.sampled_timesteps > 0
        assert np.isfinite(result["learners"]["default_policy"]["qf_loss"])
        # DQN sent its TD errors back: priorities differ, so importance weights do too
        items = buffer.sample(num_items=256, n_step=(2, 5), gamma=0.99, beta=0.4)
        weights = [it.get_extra_model_outputs("weights")[0] for it in items]
        assert max(weights) <= 1.0 and min(weights) < 0.99 * max(weights)
        algo.stop()
    finally:
        ray.shutdown()


def test_the_example_runs_rllibs_tuned_dqn_with_the_planes_buffer():
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "examples/rllib_dqn.py", "--buffer", "conduit", "--env-steps", "1000"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert line["buffer"] == "conduit" and line["env_steps"] >= 1000
    assert line["steps_to_target"] is None and line["best_return_mean"] > 0
