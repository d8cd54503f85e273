"""PPO: an actor-critic MLP, rollouts with GAE on the actor side, the clipped-surrogate update.

The actor computes advantages and returns over its own rollout (it holds the values it acted
with, and a rollout never leaves its producer before it is complete), so a stored item is
self-contained: ``obs``, ``action``, ``logp``, ``value``, ``adv``, ``ret``. GAE is cut at every
episode end; a truncated episode (time limit) bootstraps from the value of its final
observation, a terminated one from 0.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from conduit_dist.rl.grad_sync import GradSync, flat_grads
from conduit_dist.train.config import AlgoConfig

CPU = torch.device("cpu")
TERMS = ("pg", "v", "entropy", "clipfrac")
"""The loss terms :func:`ppo_loss` returns, in order."""


def _layer(n_in: int, n_out: int, std: float) -> nn.Linear:
    layer = nn.Linear(n_in, n_out)
    nn.init.orthogonal_(layer.weight, std)
    nn.init.zeros_(layer.bias)
    return layer


def _mlp(obs_dim: int, hidden: list[int], n_out: int, std: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    width = obs_dim
    for h in hidden:
        layers += [_layer(width, h, math.sqrt(2)), nn.Tanh()]
        width = h
    layers.append(_layer(width, n_out, std))
    return nn.Sequential(*layers)


class ActorCritic(nn.Module):
    """Separate policy and value MLPs (tanh, orthogonal initialisation).

    Args:
        obs_dim: observation size.
        n_actions: number of discrete actions.
        hidden: hidden layer widths of each network.
    """

    def __init__(self, obs_dim: int, n_actions: int, hidden: list[int]) -> None:
        super().__init__()
        self.actor = _mlp(obs_dim, hidden, n_actions, 0.01)
        self.critic = _mlp(obs_dim, hidden, 1, 1.0)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Action logits ``[B, n_actions]`` and values ``[B]``."""
        return self.actor(obs), self.critic(obs).squeeze(-1)


def gae(
    reward: torch.Tensor,
    value: torch.Tensor,
    next_value: torch.Tensor,
    term: torch.Tensor,
    end: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimates and returns over a rollout ``[T, E]``.

    Args:
        reward: rewards.
        value: values of the observations acted on.
        next_value: values of the next observations (the final one at an episode's end).
        term: the step terminated its episode (no bootstrap).
        end: the step ended its episode (terminated or truncated): the estimate is cut there.
        gamma: discount.
        lam: GAE lambda.

    Returns:
        ``(advantages, returns)``, both ``[T, E]``.
    """
    delta = reward + gamma * next_value * (~term).float() - value
    adv = torch.zeros_like(reward)
    carry = torch.zeros_like(reward[0])
    for t in range(reward.shape[0] - 1, -1, -1):
        carry = delta[t] + gamma * lam * (~end[t]).float() * carry
        adv[t] = carry
    return adv, adv + value


def ppo_loss(
    logits: torch.Tensor,
    value: torch.Tensor,
    batch: dict[str, torch.Tensor],
    clip: float,
    ent_coef: float,
    vf_coef: float,
    norm_adv: bool = True,
    clip_vloss: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The clipped-surrogate loss of a minibatch (CleanRL's ``ppo.py`` terms): policy, value
    (clipped around the old values) and entropy; returns the loss and its terms, a detached
    ``[4]`` tensor in the order of :data:`TERMS` (left on the loss's device: reading them is a
    host sync, done once per log, not per minibatch).

    Args:
        logits: ``[B, n_actions]`` from the current policy.
        value: ``[B]`` current values.
        batch: ``action``, ``logp`` (the acting policy's), ``adv``, ``ret``, ``value`` (old).
        clip: surrogate and value clipping.
        ent_coef: entropy bonus.
        vf_coef: value loss weight.
        norm_adv: normalise the minibatch's advantages.
        clip_vloss: clip the value loss.
    """
    logps = F.log_softmax(logits, dim=-1)  # no torch.distributions: ~1 ms less a minibatch
    logp = logps.gather(1, batch["action"][:, None]).squeeze(1)
    entropy = -(logps.exp() * logps).sum(-1).mean()
    ratio = torch.exp(logp - batch["logp"])
    adv = batch["adv"]
    if norm_adv and adv.numel() > 1:
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    pg = torch.max(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip)).mean()
    ret, old_v = batch["ret"], batch["value"]
    if clip_vloss:
        clipped = old_v + (value - old_v).clamp(-clip, clip)
        v_loss = 0.5 * torch.max((value - ret) ** 2, (clipped - ret) ** 2).mean()
    else:
        v_loss = 0.5 * ((value - ret) ** 2).mean()
    with torch.no_grad():
        clipfrac = ((ratio - 1).abs() > clip).float().mean()
        terms = torch.stack([pg, v_loss, entropy, clipfrac])
    return pg - ent_coef * entropy + vf_coef * v_loss, terms


class PPO:
    """A PPO learner/actor around one :class:`ActorCritic`.

    Several learners average their gradients after each backward in one collective over a flat
    gradient buffer (``GradSync``: an ``all_to_all_single`` of the ~36 KB for CartPole): DDP's
    per-bucket hooks cost ~4 ms a minibatch more on 2 cores, most of a 64-item update.

    Args:
        cfg: hyperparameters (``cfg.ppo`` the PPO-specific ones).
        obs_dim: observation size.
        n_actions: number of actions.
        ddp_group: average gradients over this group (``None``: a single learner); the flat
            gradient buffer lives on ``device``, so the collective runs there (NCCL on the GPU).
        device: where the network lives and learns, resolved once (``cpu`` or
            ``cuda:<index>``); rollouts are collected and GAE computed on the host.
    """

    def __init__(
        self,
        cfg: AlgoConfig,
        obs_dim: int,
        n_actions: int,
        ddp_group: dist.ProcessGroup | None = None,
        device: torch.device = CPU,
    ) -> None:
        self.cfg, self.p, self.device = cfg, cfg.ppo, device
        # built on the CPU (the same initial weights from the same seed whatever the device),
        # then moved once
        self.net = ActorCritic(obs_dim, n_actions, list(cfg.hidden)).to(device)
        self.learner: nn.Module = self.net
        self.grad_sync: GradSync | None = None
        self.flat = flat_grads(list(self.net.parameters()))
        if ddp_group is not None:
            mode = cfg.grad_sync if cfg.grad_sync in ("all_to_all", "allreduce") else "auto"
            self.grad_sync = GradSync(ddp_group, mode)
        self.opt = torch.optim.Adam(self.net.parameters(), lr=cfg.lr, eps=1e-5)
        self.steps = 0
        self.last: torch.Tensor | None = None  # the latest update's loss terms (TERMS)

    def set_lr(self, frac_left: float) -> None:
        """Anneal the learning rate linearly to 0 (``ppo.anneal_lr``)."""
        if self.p.anneal_lr:
            self.opt.param_groups[0]["lr"] = frac_left * self.cfg.lr

    @torch.no_grad()
    def act(self, obs: torch.Tensor, gen: torch.Generator) -> dict[str, torch.Tensor]:
        """Sampled actions with their log-probabilities and the observations' values.

        Args:
            obs: ``[B, obs_dim]`` on the host (the environments').
            gen: the CPU generator of the action draws (the same draws on any device).

        Returns:
            ``action``, ``logp`` and ``value``, ``[B]`` each, on the host. On the GPU: one
            host-to-device copy of ``obs`` and one device-to-host copy of the probabilities
            and values together.
        """
        logits, value = self.net(obs.to(self.device))
        probs = torch.softmax(logits, dim=-1)
        if probs.device.type != "cpu":
            both = torch.cat([probs, value[:, None]], dim=1).cpu()
            probs, value = both[:, :-1], both[:, -1]
        action = torch.multinomial(probs, 1, generator=gen).squeeze(1)
        logp = torch.log(probs.gather(1, action[:, None]).squeeze(1).clamp_min(1e-12))
        return {"action": action, "logp": logp, "value": value}

    @torch.no_grad()
    def finish_rollout(self, steps: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The rollout's items ``[T * E]`` with advantages and returns (GAE, actor side).

        Args:
            steps: per step, the env's transition batch joined with :meth:`act`'s output (on
                the host).

        Returns:
            ``obs``, ``action``, ``logp``, ``value``, ``adv`` and ``ret`` on the host.
        """
        cat = {k: torch.stack([s[k] for s in steps]) for k in steps[0]}
        t, e = cat["reward"].shape
        # one copy each way on the GPU: the next observations in, their values out
        _, next_value = self.net(cat["next_obs"].reshape(t * e, -1).to(self.device))
        next_value = next_value.cpu()
        end = cat["done"] | cat["truncated"]
        adv, ret = gae(
            cat["reward"], cat["value"], next_value.view(t, e), cat["done"], end,
            self.cfg.gamma, self.p.gae_lambda,
        )  # fmt: skip
        flat = {k: cat[k].reshape(t * e, *cat[k].shape[2:]) for k in ("obs", "action", "logp")}
        flat.update(value=cat["value"].reshape(-1), adv=adv.reshape(-1), ret=ret.reshape(-1))
        return flat

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Clipped surrogate + value loss (clipped) - entropy bonus on a minibatch
        (:func:`ppo_loss`); :attr:`last` keeps its terms."""
        p = self.p
        logits, value = self.net(batch["obs"])
        loss, self.last = ppo_loss(
            logits, value, batch, p.clip_coef, p.ent_coef, p.vf_coef, p.norm_adv, p.clip_vloss
        )
        return loss

    def step(self) -> None:
        """Average the gradients over the learners, clip them, apply the optimizer step."""
        if self.grad_sync is not None:
            self.flat.copy_(self.grad_sync.reduce(self.flat).wait())
        nn.utils.clip_grad_norm_(self.net.parameters(), self.cfg.max_grad_norm)
        self.opt.step()
        self.flat.zero_()
        self.steps += 1

    def state_dict(self) -> dict[str, object]:
        """Network, optimizer and step counter."""
        return {"net": self.net.state_dict(), "opt": self.opt.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore from :meth:`state_dict`."""
        self.net.load_state_dict(state["net"])
        self.opt.load_state_dict(state["opt"])
        self.steps = int(state["steps"])


def rollout_spec_example(obs_dim: int) -> dict[str, torch.Tensor]:
    """One item of a PPO rollout (the spec the plane stores)."""
    return {
        "obs": torch.zeros(1, obs_dim),
        "action": torch.zeros(1, dtype=torch.int64),
        "logp": torch.zeros(1),
        "value": torch.zeros(1),
        "adv": torch.zeros(1),
        "ret": torch.zeros(1),
    }
