"""RLlib's replay buffer, backed by the plane: select it by configuration, nothing of RLlib
patched (``pip install conduit_dist[rllib]``; docs/rllib.md).

RLlib's off-policy algorithms on its current API stack (DQN, SAC) take their buffer from
``config.training(replay_buffer_config={"type": <class>, ...})`` and call its episode-based
``add`` / ``sample`` / ``update_priorities`` / ``get_state`` / ``set_state``. The two classes here
are those extension points (subclasses of RLlib's episode buffers, as its ``validate`` and its
priority update require), with the store, the draws and the priorities in a
:class:`~conduit_dist.DataPlane`::

    from conduit_dist.integrations.rllib import PRIORITIZED

    config.training(
        replay_buffer_config={"type": PRIORITIZED,  # the class's dotted path
                              "capacity": 50_000, "alpha": 0.6, "beta": 0.4, "n_step": (2, 5)},
        n_step=(2, 5),
    )

``"type"`` is the class's dotted path (:data:`PRIORITIZED`, :data:`UNIFORM`), a form RLlib's
``from_config`` imports: RLlib 2.60's ``Algorithm`` tests the type by name (``"EpisodeReplayBuffer"
in type``), which a class object fails.

What is stored: one row per environment step (``obs``, ``next_obs``, ``action``, ``reward``, the
episode's ``terminated``/``truncated`` on its last step), each episode a stream of its own
(chunks of one episode continue it), and after an episode's last step ``max_n - 1`` padding
rows, so that every step of an episode starts a window of ``max_n`` rows that never crosses into
another episode (``Windows(length=max_n)``). A sample draws windows from the plane, exact: with
probability ``(p + eps)^alpha / sum`` (``alpha=0``: uniform) over the steps whose window is
complete, i.i.d. RLlib's n-step (an int, or a ``(lo, hi)`` range drawn per item, ``hi``
exclusive) is applied to each drawn window; a draw whose n steps run past its episode's end is
rejected and drawn again, as RLlib's own buffer does, so the accepted items are distributed as
RLlib's (``docs/rllib.md`` says where the two differ). Each item comes back as RLlib's: a
1-step ``SingleAgentEpisode`` ``(o_t, a_t, sum_k gamma^k r_(t+k), o_(t+n))`` with
``extra_model_outputs["weights"]`` (importance weights, ``(m_i / m_min)^-beta``) and
``["n_step"]``.
"""

from __future__ import annotations

import gc
import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from conduit_dist.errors import ConfigError, EmptyStoreError, SpecError
from conduit_dist.extras import require

with require("rllib", "conduit_dist.integrations.rllib"):
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode
    from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer
    from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import (
        PrioritizedEpisodeReplayBuffer,
    )

_COLUMNS = ("reward", "obs", "next_obs", "action", "terminated", "truncated", "t")
_MAX_DRAWS = 64  # rounds of draws a sample takes at most (each adds what was accepted)

PRIORITIZED = "conduit_dist.integrations.rllib.ConduitPrioritizedEpisodeReplayBuffer"
UNIFORM = "conduit_dist.integrations.rllib.ConduitEpisodeReplayBuffer"

_DTYPES = {  # numpy dtypes of observations and actions the rows keep
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
    np.dtype(np.float16): torch.float16,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.bool_): torch.bool,
}


def _max_n(n_step: int | Sequence[int]) -> int:
    """The longest n a buffer configured with ``n_step`` serves (a ``(lo, hi)`` range: hi - 1).

    Raises:
        ConfigError: on anything but an int >= 1 or a range ``lo < hi`` with ``lo >= 1``.
    """
    if isinstance(n_step, bool) or not isinstance(n_step, (int, tuple, list)):
        raise ConfigError(
            f"replay_buffer_config['n_step']: expected an int >= 1 or a (lo, hi) range, got "
            f"{n_step!r}"
        )
    if isinstance(n_step, int):
        if n_step < 1:
            raise ConfigError(f"replay_buffer_config['n_step']: expected >= 1, got {n_step}")
        return n_step
    if (
        len(n_step) != 2
        or not all(isinstance(v, int) for v in n_step)
        or not (1 <= n_step[0] < n_step[1])
    ):
        raise ConfigError(
            "replay_buffer_config['n_step']: expected a range (lo, hi) of ints, 1 <= lo < hi "
            f"(hi exclusive, as RLlib draws it), got {n_step!r}"
        )
    return n_step[1] - 1


def _field(name: str, value: np.ndarray) -> tuple[tuple[int, ...], torch.dtype]:
    """A row field's per-step shape and dtype from a chunk's ``[n, ...]`` array.

    Raises:
        SpecError: on a dtype the rows cannot keep (naming the field).
    """
    dtype = _DTYPES.get(value.dtype)
    if dtype is None:
        raise SpecError(
            f"rllib buffer: episode {name}s of dtype {value.dtype}: expected one of "
            f"{sorted(str(d) for d in _DTYPES)} (a Box or Discrete space; flatten dict and "
            "tuple spaces with RLlib's connectors first)"
        )
    return tuple(value.shape[1:]), dtype


# SingleAgentEpisode's slots an item sets per item, and those it shares with a template the
# constructor built (immutable values, or the spaces every item of RLlib's buffer shares too;
# the lookback buffers' space structures are shared as well, which nothing in RLlib mutates)
_PER_ITEM = frozenset((
    "id_", "observations", "infos", "actions", "rewards", "extra_model_outputs",
    "is_terminated", "is_truncated", "t_started", "t", "_custom_data",
))  # fmt: skip
_SHARED = frozenset((
    "agent_id", "module_id", "multi_agent_episode_id", "_observation_space", "_action_space",
    "_last_added_observation", "_last_added_infos", "_last_step_time", "_start_time",
))  # fmt: skip
_BUFFER_KEYS = frozenset(("data", "lookback", "finalized", "_space", "_space_struct"))
_warned = False  # the slower path's warning, once per process
log = logging.getLogger("conduit_dist")


def _warn_slow() -> None:
    """Say once per process that items are built through RLlib's constructor."""
    global _warned
    if not _warned:
        _warned = True
        log.warning(
            "rllib buffer: this RLlib's SingleAgentEpisode has other slots than the ones the "
            "buffer copies (ray 2.60's); every sampled item is built through its constructor "
            "instead (~4x slower per item)"
        )


class _Items:
    """RLlib's 1-step ``SingleAgentEpisode`` items ``(o_t, a_t, R, o_(t+n))``, built as RLlib's
    buffers build them, at a quarter of the constructor's cost.

    The constructor spends most of an item's ~17 us deriving each lookback buffer's space
    structure again (``get_base_struct_from_space``, 8 times) and validating. Here one item per
    :meth:`items` call goes through the constructor (validated), and the others are that
    template's copies with their own values: fresh lookback buffers (the template's spaces and
    space structures, each item's data lists), fresh dicts, the spaces shared as RLlib shares
    them. Every slot equals what the constructor gives for the same values
    (``tests/test_rllib.py``). Where the installed RLlib's episode has other slots than these
    (another version), every item goes through the constructor (``fast`` is ``False``).

    Args:
        obs_space, act_space: the episodes' spaces, given to every item.
    """

    def __init__(self, obs_space, act_space) -> None:
        from ray.rllib.env.utils.infinite_lookback_buffer import InfiniteLookbackBuffer

        self.spaces = (obs_space, act_space)
        self._buffer = InfiniteLookbackBuffer
        probe = self._made(np.zeros(1), np.zeros(1), 0, 0.0, False, False, 1.0, 1, 0)
        self.fast = set(SingleAgentEpisode.__slots__) == _PER_ITEM | _SHARED and all(
            set(getattr(b, "__dict__", ())) == _BUFFER_KEYS for b in self._buffers(probe)
        )
        if not self.fast and obs_space is not None:
            _warn_slow()

    @staticmethod
    def _buffers(item) -> list:
        return [item.observations, item.infos, item.actions, item.rewards,
                *item.extra_model_outputs.values()]  # fmt: skip

    def _made(self, o, x, a, r, te, tr, w, n, t):
        """One item through RLlib's constructor (validated)."""
        return SingleAgentEpisode(
            observations=[o, x],
            observation_space=self.spaces[0],
            actions=[a],
            action_space=self.spaces[1],
            rewards=[r],
            terminated=te,
            truncated=tr,
            extra_model_outputs={"weights": [w], "n_step": [n]},
            len_lookback_buffer=0,
            t_started=t,
        )

    def items(self, rows) -> list:
        """One item per row ``(o, x, a, r, terminated, truncated, weight, n, t_started)``.

        The cyclic garbage collector is paused while they are built (and restored as it was):
        an item is ~20 tracked containers, so a batch of 256 crosses the young generation's
        threshold several times; each collection finds the items built so far alive and moves
        them to an older generation, until a full collection walks the whole heap (RLlib's
        imports alone are ~300,000 objects). Measured at 256 items: 5.9 ms with the collector
        running, 1.0 ms paused (means, a full collection every few calls). A collection is
        deferred by the build's time at most. The collector is enabled again only where it
        was: a thread that disables it during a build finds it enabled after."""
        was = gc.isenabled()
        gc.disable()
        try:
            return self._items(rows)
        finally:
            if was:
                gc.enable()

    def _items(self, rows) -> list:
        rows = iter(rows)
        first = next(rows, None)
        if first is None:
            return []
        made = self._made(*first)
        out = [made]
        if not self.fast:
            return out + [self._made(*row) for row in rows]
        shared = [(k, getattr(made, k)) for k in _SHARED]
        bo, bi, ba, br, bw, bn = (vars(b) for b in self._buffers(made))
        new, buf, episode = object.__new__, self._buffer, SingleAgentEpisode
        prefix = made.id_[:24]  # a fresh uuid4's: every id of this call is new in the process
        made.id_ = f"{prefix}{0:08x}"  # the template's too (its own tail could equal a copy's)
        for k, (o, x, a, r, te, tr, w, n, t) in enumerate(rows, 1):
            e = new(episode)
            for key, v in shared:
                setattr(e, key, v)
            e.id_ = f"{prefix}{k:08x}"  # unique in the process, as a uuid4's hex is
            b = new(buf)
            b.__dict__.update(bo, data=[o, x])
            e.observations = b
            b = new(buf)
            b.__dict__.update(bi, data=[{}, {}])
            e.infos = b
            b = new(buf)
            b.__dict__.update(ba, data=[a])
            e.actions = b
            b = new(buf)
            b.__dict__.update(br, data=[r])
            e.rewards = b
            bw_, bn_ = new(buf), new(buf)
            bw_.__dict__.update(bw, data=[w])
            bn_.__dict__.update(bn, data=[n])
            e.extra_model_outputs = {"weights": bw_, "n_step": bn_}
            e.is_terminated, e.is_truncated = te, tr
            e.t_started, e.t = t, t + 1
            e._custom_data = {}
            out.append(e)
        return out


class _PlaneRows:
    """What both buffers share: episodes to rows, the plane, windows to RLlib's items."""

    def __init__(
        self,
        capacity: int,
        alpha: float,
        n_step: int | Sequence[int],
        seed: int,
        eps: float,
        uniform: bool = False,
    ) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ConfigError(
                f"replay_buffer_config['capacity']: expected an int >= 1, got {capacity!r}"
            )
        self.capacity = capacity
        self.alpha = float(alpha)
        self.eps = float(eps)
        self.max_n = _max_n(n_step)
        self.seed = int(seed)
        self.plane = None  # built at the first add (the spaces come with the episodes)
        self.spec_desc: dict[str, tuple[tuple[int, ...], str]] | None = None
        # RLlib's items, with the episodes' spaces once an add brought them
        self.maker, self.have_spaces = _Items(None, None), False
        self.eids: dict[str, int] = {}  # open episodes' streams
        self.next_eid = 0
        self.last_index: torch.Tensor | None = None  # the last sample's accepted items
        self.staged = False  # rows put since the plane's last round
        self.steps_added = 0
        self.steps_stored = 0  # environment steps (not padding) stored, evictions aside
        self.samples = 0  # sample calls: with the seed, they fix each call's n draws
        self.accepted = 1.0  # the share of draws accepted (n steps inside the episode), smoothed
        # RLlib's uniform buffer cuts n at the episode's end; its prioritized one rejects
        self.cut_short = alpha == 0 and uniform

    # -- building -------------------------------------------------------------------------

    def _build(self, desc: dict[str, tuple[tuple[int, ...], str]]) -> None:
        import conduit_dist as cd

        fields = {name: (shape, getattr(torch, dt)) for name, (shape, dt) in desc.items()}
        spec = cd.ExperienceSpec(fields)
        windows = None  # n_step=1: single items
        if self.max_n > 1:
            windows = cd.Windows(length=self.max_n, done="link_end", stream="eid")
        sampler = cd.Prioritized(alpha=self.alpha, beta=0.0, eps=self.eps, sequence=windows)
        self.plane = cd.DataPlane(
            spec, self.capacity, seed=self.seed, sampler=sampler, schedule="sync", max_lag=0
        )
        self.spec_desc = desc

    def _describe(self, obs: np.ndarray, actions: np.ndarray) -> dict:
        obs_shape, obs_dt = _field("observation", obs)
        act_shape, act_dt = _field("action", actions)
        return {
            "obs": (obs_shape, str(obs_dt).removeprefix("torch.")),
            "next_obs": (obs_shape, str(obs_dt).removeprefix("torch.")),
            "action": (act_shape, str(act_dt).removeprefix("torch.")),
            "reward": ((), "float32"),
            "terminated": ((), "bool"),
            "truncated": ((), "bool"),
            "link_end": ((), "bool"),
            "pad": ((), "bool"),
            "eid": ((), "int64"),
            "t": ((), "int64"),
        }

    # -- add --------------------------------------------------------------------------------

    def add(self, episodes: Sequence) -> int:
        """Put each episode chunk's steps as rows (and an ended episode's padding); returns the
        environment steps added.

        Raises:
            SpecError: on a chunk whose observations or actions differ from the first one's
                (shape or dtype; nothing of the call is stored), or an unsupported dtype.
        """
        batches = []
        for eps in episodes:
            if not isinstance(eps, SingleAgentEpisode):
                raise SpecError(
                    f"rllib buffer: add: expected SingleAgentEpisode chunks, got "
                    f"{type(eps).__name__} (multi-agent episodes are not served by this buffer; "
                    "nothing of this add was stored)"
                )
            n = len(eps)
            if n == 0:
                continue
            obs = np.asarray(eps.get_observations(slice(0, n + 1)))
            actions = np.asarray(eps.get_actions(slice(0, n)))
            rewards = np.asarray(eps.get_rewards(slice(0, n)), dtype=np.float32)
            desc = self._describe(obs, actions)
            if not self.have_spaces:  # the first add (a restored buffer's too, if it is new)
                self.maker = _Items(eps.observation_space, eps.action_space)
                self.have_spaces = True
            if self.spec_desc is None:
                self._build(desc)
            elif desc != self.spec_desc:
                diff = {
                    k: (self.spec_desc[k], v) for k, v in desc.items() if self.spec_desc[k] != v
                }
                raise SpecError(
                    f"rllib buffer: episode {eps.id_!r}: (expected, received) (shape, dtype) "
                    f"by field: {diff}; nothing of this add was stored"
                )
            batches.append((eps, n, obs, actions, rewards))
        added = 0
        for eps, n, obs, actions, rewards in batches:
            done = bool(eps.is_terminated or eps.is_truncated)
            eid = self.eids.get(eps.id_)
            if eid is None:
                eid = self.eids[eps.id_] = self.next_eid
                self.next_eid += 1
            pad = self.max_n - 1 if done else 0
            rows = n + pad
            last = np.zeros(rows, dtype=bool)
            term, trunc = last.copy(), last.copy()
            term[n - 1], trunc[n - 1] = bool(eps.is_terminated), bool(eps.is_truncated)
            if done:
                last[-1] = True
            obs_rows = np.concatenate([obs[:n], np.repeat(obs[n:], pad, axis=0)])
            next_rows = np.concatenate([obs[1:], np.repeat(obs[n:], pad, axis=0)])
            act_rows = np.concatenate([actions, np.zeros((pad, *actions.shape[1:]), actions.dtype)])
            self.plane.put({
                "obs": torch.from_numpy(obs_rows),
                "next_obs": torch.from_numpy(next_rows),
                "action": torch.from_numpy(act_rows),
                "reward": torch.from_numpy(np.concatenate([rewards, np.zeros(pad, np.float32)])),
                "terminated": torch.from_numpy(term),
                "truncated": torch.from_numpy(trunc),
                "link_end": torch.from_numpy(last),
                "pad": torch.from_numpy(np.arange(rows) >= n),
                "eid": torch.full((rows,), eid, dtype=torch.int64),
                "t": torch.arange(eps.t_started, eps.t_started + rows, dtype=torch.int64),
            })  # fmt: skip
            if done:
                del self.eids[eps.id_]
            added += n
            self.staged = True
        self.steps_added += added
        self.steps_stored = min(self.steps_stored + added, self.capacity)
        return added

    # -- sample -----------------------------------------------------------------------------

    def sample(
        self, count: int, n_step: int | Sequence[int] | None, gamma: float, beta: float | None
    ) -> tuple[list, int]:
        """``count`` items as RLlib's 1-step episodes, and the draws rejected.

        Raises:
            ConfigError: if ``n_step`` asks for more steps than the buffer was built for, or
                ``count`` is not an int >= 1.
            EmptyStoreError: if no window is complete yet (the plane's).
        """
        if self.plane is None:
            raise EmptyStoreError("rllib buffer: sample before any add: nothing is stored")
        if not isinstance(count, int) or count < 1:
            raise ConfigError(f"rllib buffer: sample: expected num_items >= 1, got {count!r}")
        n_step = 1 if n_step is None else n_step
        want = _max_n(n_step)
        if want > self.max_n:
            raise ConfigError(
                f"rllib buffer: sample(n_step={n_step!r}) needs windows of {want} steps, the "
                f"buffer keeps {self.max_n}: set replay_buffer_config['n_step'] to the "
                "algorithm's n_step"
            )
        sampler = self.plane.sampler
        sampler.beta = 0.0 if beta is None else float(beta)
        parts, need, rejected = [], count, 0
        rng = np.random.default_rng([self.seed, self.samples])
        self.samples += 1
        for _ in range(_MAX_DRAWS):
            # enough draws that the accepted ones usually fill the batch in one round: the
            # share accepted so far (draws past the batch are dropped; the rest stay i.i.d.)
            ask = math.ceil(need / self.accepted * 1.1) + 2
            # with replacement, as RLlib's buffers draw, even from fewer items than asked for
            batch = self.plane.fetch(min(ask, 8 * count), oversample=True)
            self.staged = False
            if self.max_n == 1:  # single items: as windows of one
                batch = {k: v if k.startswith("_") else v.unsqueeze(1) for k, v in batch.items()}
            size = batch["_index"].shape[0]
            if isinstance(n_step, int):
                ns = np.full(size, n_step, dtype=np.int64)
            else:  # drawn per item, from a stream fixed by (seed, sample call, draw)
                ns = rng.integers(n_step[0], n_step[1], size=size)
            pad = batch["pad"].numpy()
            if self.cut_short:  # RLlib's uniform buffer: n cut at the episode's end
                ns = np.minimum(ns, (~pad).sum(axis=1))  # padding only trails the episode
            ok = ~pad[np.arange(size), ns - 1]  # the n steps stay inside the episode
            rejected += int(size - ok.sum())
            self.accepted = max(0.05, 0.9 * self.accepted + 0.1 * float(ok.mean()))
            keep = np.flatnonzero(ok)[:need]
            if len(keep):
                parts.append((batch, ns, keep))
                need -= len(keep)
            if need == 0:
                break
        if need:
            raise EmptyStoreError(
                f"rllib buffer: sample(num_items={count}, n_step={n_step!r}): {count - need} "
                f"of {count} items accepted after {_MAX_DRAWS} rounds of draws; every draw "
                "ran past its episode's end: the stored episodes are shorter than n_step"
            )
        items, index = [], []
        for batch, ns, keep in parts:
            items += self._episodes(batch, ns, keep, gamma)
            index.append(batch["_index"][torch.from_numpy(keep)])
        self.last_index = index[0] if len(index) == 1 else torch.cat(index)
        return items, rejected

    def _episodes(self, batch, ns: np.ndarray, keep: np.ndarray, gamma: float) -> list:
        """RLlib's 1-step episodes of the kept windows (n-step applied)."""
        col = {k: batch[k].numpy()[keep] for k in _COLUMNS}  # [b, max_n, ...] each
        n = ns[keep]
        at, last = np.arange(len(keep)), n - 1
        rewards = col["reward"].astype(np.float64)
        disc = gamma ** np.arange(rewards.shape[1], dtype=np.float64)
        mask = np.arange(rewards.shape[1])[None, :] < n[:, None]
        ret = (rewards * disc * mask).sum(axis=1).tolist()
        term = col["terminated"][at, last].tolist()
        trunc = col["truncated"][at, last].tolist()
        t0 = col["t"][:, 0].tolist()
        w = batch["_weight"].numpy()[keep].tolist()
        rows = zip(
            col["obs"][:, 0], col["next_obs"][at, last], col["action"][:, 0], ret, term, trunc,
            w, n.tolist(), t0,
        )  # fmt: skip
        return self.maker.items(rows)

    def update(self, priorities) -> None:
        """The last sample's accepted items' new priorities (queued to the plane).

        Raises:
            SpecError: on a count other than the last sample's, or a negative or non-finite
                priority (naming the first).
        """
        if self.last_index is None:
            raise SpecError("rllib buffer: update_priorities before any sample")
        p = np.asarray(priorities, dtype=np.float64).reshape(-1)
        if p.size != self.last_index.numel():
            raise SpecError(
                f"rllib buffer: update_priorities: expected {self.last_index.numel()} priorities "
                f"(the last sample's items), got {p.size}"
            )
        if not (np.isfinite(p).all() and (p >= 0).all()):
            i = int(np.flatnonzero(~np.isfinite(p) | (p < 0))[0])
            raise SpecError(
                f"rllib buffer: update_priorities: expected finite priorities >= 0, got "
                f"{float(p[i])} at item {i}"
            )
        self.plane.update_priorities(self.last_index, torch.from_numpy(p))
        self.last_index = None

    # -- state ------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Everything to restore: the plane's store (tensors) and the open episodes' streams."""
        if self.staged:  # rows put since the last round: a round stores them first
            self.plane.flush()
            self.plane.wait()
            self.staged = False
        return {
            "format": 1,
            "spec": None if self.spec_desc is None else {
                k: [list(s), d] for k, (s, d) in self.spec_desc.items()
            },
            "plane": None if self.plane is None else self.plane.state_dict(),
            "eids": list(self.eids.items()),
            "next_eid": self.next_eid,
            "max_n": self.max_n,
            "alpha": self.alpha,
            "steps_added": self.steps_added,
            "steps_stored": self.steps_stored,
            "samples": self.samples,
            "accepted": self.accepted,
            "last_index": self.last_index,
        }  # fmt: skip

    def load(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state` into a buffer built with the same settings.

        Raises:
            ConfigError: on another format, alpha or n-step range (naming them).
        """
        for key, mine in (("format", 1), ("max_n", self.max_n), ("alpha", self.alpha)):
            if state.get(key) != mine:
                raise ConfigError(
                    f"rllib buffer: set_state: the state's {key} is {state.get(key)!r}, this "
                    f"buffer's {mine!r}: restore into a buffer with the same replay_buffer_config"
                )
        if state["spec"] is not None:
            desc = {k: (tuple(s), d) for k, (s, d) in state["spec"].items()}
            if self.plane is None:
                self._build(desc)
            elif desc != self.spec_desc:
                raise ConfigError(
                    f"rllib buffer: set_state: the state's rows {desc} differ from this "
                    f"buffer's {self.spec_desc}"
                )
            self.plane.load_state_dict(state["plane"])
        self.eids = dict(state["eids"])
        self.next_eid = int(state["next_eid"])
        self.steps_added = int(state["steps_added"])
        self.steps_stored = int(state["steps_stored"])
        self.samples = int(state["samples"])
        self.accepted = float(state["accepted"])
        self.last_index = state["last_index"]
        self.staged = False


class _OnPlane:
    """What both buffers do the same way, on the plane's rows (``self._rows``, set by
    :func:`_setup`): RLlib's ``add``, ``sample``, ``get_state``/``set_state`` and ``len``."""

    @property
    def plane(self):
        """The :class:`~conduit_dist.DataPlane` holding the rows (``None`` before any add)."""
        return self._rows.plane

    def __len__(self) -> int:
        return self._rows.steps_stored

    def add(self, episodes, weight: float | None = None) -> None:
        """Store episodes (or chunks of them) from RLlib's env runners.

        Args:
            episodes: a ``SingleAgentEpisode`` or a list of them.
            weight: refused unless ``None`` (new items enter at the largest priority so far,
                the plane's rule).

        Raises:
            SpecError: on observations or actions that differ from the first episode's, or
                a ``weight``.
        """
        if weight is not None:
            raise SpecError(
                f"rllib buffer: add(weight={weight!r}): expected None (new steps enter with the "
                "largest priority so far)"
            )
        eps = episodes if isinstance(episodes, (list, tuple)) else [episodes]
        added = self._rows.add(eps)
        self._num_timesteps = len(self)
        self._num_timesteps_added = self._rows.steps_added
        self.metrics.log_value("num_env_steps_added", added, reduce="sum")

    def sample(
        self,
        num_items: int | None = None,
        *,
        batch_size_B: int | None = None,
        batch_length_T: int | None = None,
        n_step: int | Sequence[int] | None = None,
        beta: float | None = 0.0,
        gamma: float = 0.99,
        include_infos: bool = False,
        include_extra_model_outputs: bool = False,
        **kwargs,
    ) -> list:
        """``num_items`` transitions as RLlib's 1-step ``SingleAgentEpisode``s, n-step applied
        (``extra_model_outputs``: ``"weights"``, ``"n_step"``).

        Raises:
            ConfigError: on sequences (``batch_length_T > 1``), infos or extra model outputs
                asked for (not kept), or an ``n_step`` beyond the configured one.
        """
        if num_items is not None and batch_size_B is not None:
            raise ConfigError("rllib buffer: sample: give num_items or batch_size_B, not both")
        _one_step(batch_length_T)
        if include_infos or include_extra_model_outputs:
            raise ConfigError(
                "rllib buffer: sample(include_infos/include_extra_model_outputs=True): the "
                "rows keep observations, actions, rewards and episode ends only"
            )
        count = num_items or batch_size_B or self.batch_size_B
        items, rejected = self._rows.sample(count, n_step, gamma, beta)  # alpha=0: weights 1
        self.sampled_timesteps += count
        self.metrics.log_value("num_env_steps_sampled", count, reduce="sum")
        if rejected:
            self.metrics.log_value("num_resamples", rejected, reduce="sum")
        return items

    def get_state(self) -> dict[str, Any]:
        """The buffer's state for RLlib's checkpoints: the plane's store (tensors, ints,
        dicts; what ``torch.load(weights_only=True)`` reads) and the open episodes."""
        return {"conduit": self._rows.state(), "sampled_timesteps": self.sampled_timesteps}

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`get_state` (a buffer built with the same configuration).

        Raises:
            ConfigError: on a state of another buffer kind or configuration.
        """
        if "conduit" not in state:
            raise ConfigError(
                f"rllib buffer: set_state: expected a conduit buffer's state (key 'conduit'), "
                f"got keys {sorted(state)} (RLlib's own buffer's state does not load here)"
            )
        self._rows.load(state["conduit"])
        self.sampled_timesteps = int(state["sampled_timesteps"])
        self._num_timesteps = len(self)
        self._num_timesteps_added = self._rows.steps_added


class ConduitEpisodeReplayBuffer(_OnPlane, EpisodeReplayBuffer):
    """RLlib's uniform episode buffer, on the plane (``alpha=0``: every complete window as
    likely; importance weights 1). See the module docstring.

    Args:
        capacity: rows kept (environment steps and each ended episode's ``max_n - 1``
            padding rows); the oldest go first.
        batch_size_B: items a ``sample()`` without ``num_items`` returns.
        batch_length_T: 1 (sequences for stateful modules are not served).
        n_step: the algorithm's ``n_step`` (an int or RLlib's ``(lo, hi)`` range): the
            windows the rows are kept for. A sample asking for more is refused.
        seed: the plane's draws and the per-item n draws.
        eps: added to every priority.
        kwargs: RLlib's other buffer settings (``metrics_num_episodes_for_smoothing``; the
            prioritized ``alpha``/``beta`` DQN's config keeps are ignored here, as RLlib's
            uniform buffer ignores them).

    Raises:
        ConfigError: on a bad capacity, ``n_step`` or ``batch_length_T``.
    """

    def __init__(
        self,
        capacity: int = 10000,
        *,
        batch_size_B: int = 16,
        batch_length_T: int = 1,
        n_step: int | Sequence[int] = 1,
        seed: int = 0,
        eps: float = 1e-6,
        **kwargs,
    ) -> None:
        # RLlib's DQN config keeps its prioritized defaults (alpha, beta) when only "type" is
        # set; a uniform buffer ignores them, as RLlib's EpisodeReplayBuffer does
        _setup(self, capacity, batch_size_B, batch_length_T, 0.0, n_step, seed, eps, kwargs, True)


class ConduitPrioritizedEpisodeReplayBuffer(_OnPlane, PrioritizedEpisodeReplayBuffer):
    """RLlib's prioritized episode buffer, on the plane: draws with probability
    ``(p + eps)^alpha / sum`` over complete windows, exact, and ``update_priorities`` for the
    last sample's items (RLlib's DQN calls it after each update). See the module docstring and
    :class:`ConduitEpisodeReplayBuffer` for the arguments.
    """

    def __init__(
        self,
        capacity: int = 10000,
        *,
        batch_size_B: int = 16,
        batch_length_T: int = 1,
        alpha: float = 1.0,
        n_step: int | Sequence[int] = 1,
        seed: int = 0,
        eps: float = 1e-6,
        **kwargs,
    ) -> None:
        # RLlib's own segment trees are not built: the plane holds the priorities
        _setup(self, capacity, batch_size_B, batch_length_T, alpha, n_step, seed, eps, kwargs)
        self._alpha = float(alpha)
        self._last_sampled_indices = []

    def update_priorities(self, priorities, module_id: str | None = None) -> None:
        """New priorities (RLlib's TD errors) for the last sample's items, in its order.

        Raises:
            SpecError: on another count than the last sample's, a negative or non-finite
                priority, or no sample before.
        """
        self._rows.update(priorities)


def _setup(
    buf, capacity, batch_size_B, batch_length_T, alpha, n_step, seed, eps, kwargs, uniform=False
) -> None:
    """What both buffers' constructors do: RLlib's base buffer (its counters and metrics; no
    episode store used), the checks, and the plane's rows.

    Raises:
        ConfigError: on a bad ``batch_length_T``, ``alpha``, ``capacity`` or ``n_step``.
    """
    EpisodeReplayBuffer.__init__(
        buf, capacity=capacity, batch_size_B=batch_size_B, batch_length_T=1,
        **{k: v for k, v in kwargs.items() if k == "metrics_num_episodes_for_smoothing"},
    )  # fmt: skip
    _one_step(batch_length_T)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha >= 0:
        raise ConfigError(f"replay_buffer_config['alpha']: expected a number >= 0, got {alpha!r}")
    buf._rows = _PlaneRows(capacity, alpha, n_step, seed, eps, uniform=alpha == 0 and uniform)


def _one_step(batch_length_T: int | None) -> None:
    """Refuse sequences: the rows serve 1-step transitions (n-step applied).

    Raises:
        ConfigError: on ``batch_length_T > 1``.
    """
    if batch_length_T not in (None, 0, 1):
        raise ConfigError(
            f"rllib buffer: batch_length_T={batch_length_T!r}: expected 1 (transitions; "
            "sequences for stateful modules are not served by this buffer)"
        )
