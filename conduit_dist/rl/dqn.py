"""DQN: Q-network, epsilon-greedy acting, double-DQN update with a soft-updated target."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from conduit_dist.rl.grad_sync import GradSync
from conduit_dist.rl.grad_sync import flat_grads as flat_buffer
from conduit_dist.train.config import AlgoConfig

CPU = torch.device("cpu")


class QNetwork(nn.Module):
    """An MLP from observations to one Q-value per action.

    Args:
        obs_dim: observation size.
        n_actions: number of discrete actions.
        hidden: hidden layer widths.
    """

    def __init__(self, obs_dim: int, n_actions: int, hidden: list[int]) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = obs_dim
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, n_actions))
        self.net = nn.Sequential(*layers)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        """Q-values ``[B, n_actions]``."""
        return self.net(obs)


class DQN:
    """A DQN learner/actor around one Q-network (optionally DDP-wrapped for the update).

    Args:
        cfg: hyperparameters.
        obs_dim: observation size.
        n_actions: number of actions.
        ddp_group: average gradients over this group with DistributedDataParallel (``None``: a
            single learner, no DDP); buckets are averaged by :class:`GradSync` (``cfg.grad_sync``),
            on the device (NCCL for a network on the GPU).
        flat_grads: keep the gradients as views of one flat buffer, :attr:`flat` (for
            ``grad_sync=round``: the data plane averages it inside a round).
        device: where the networks live and learn, resolved once (``cpu`` or ``cuda:<index>``,
            ``train.setup.device``); batches arrive there from the plane.
    """

    def __init__(
        self,
        cfg: AlgoConfig,
        obs_dim: int,
        n_actions: int,
        ddp_group: dist.ProcessGroup | None = None,
        flat_grads: bool = False,
        device: torch.device = CPU,
    ) -> None:
        self.cfg, self.device = cfg, device
        self.n_actions = n_actions
        # built on the CPU (the same initial weights from the same seed whatever the device),
        # then moved once
        self.q = QNetwork(obs_dim, n_actions, list(cfg.hidden)).to(device)
        self.target = copy.deepcopy(self.q).requires_grad_(False)
        self.learner: nn.Module = self.q
        self.grad_sync: GradSync | None = None
        if ddp_group is not None:
            self.learner = nn.parallel.DistributedDataParallel(
                self.q,
                device_ids=[device.index] if device.type == "cuda" else None,
                process_group=ddp_group,
            )
            self.grad_sync = GradSync(ddp_group, cfg.grad_sync)
            self.learner.register_comm_hook(self.grad_sync, GradSync.hook)
        self.opt = torch.optim.Adam(self.q.parameters(), lr=cfg.lr)
        self.steps = 0
        self.last_td: torch.Tensor | None = None  # |TD error| of the latest weighted loss
        self.flat: torch.Tensor | None = None  # flat gradient buffer (flat_grads)
        if flat_grads:
            self.flat = flat_buffer(list(self.q.parameters()))

    def epsilon(self, env_steps: int) -> float:
        """Linearly decayed exploration rate at ``env_steps`` (all ranks)."""
        frac = min(env_steps / max(self.cfg.eps_decay_steps, 1), 1.0)
        return self.cfg.eps_start + frac * (self.cfg.eps_end - self.cfg.eps_start)

    @torch.no_grad()
    def act(self, obs: torch.Tensor, epsilon: float, gen: torch.Generator) -> torch.Tensor:
        """Epsilon-greedy actions for a batch of observations.

        Args:
            obs: ``[B, obs_dim]`` on the host (the environments').
            epsilon: the exploration rate.
            gen: the CPU generator of the exploration draws (the same draws on any device).

        Returns:
            ``[B]`` int64 actions on the host. On the GPU: one host-to-device copy of ``obs``
            and one device-to-host copy of the greedy actions (none when every action
            explores).
        """
        explore = torch.rand(obs.shape[0], generator=gen) < epsilon
        random = torch.randint(self.n_actions, (obs.shape[0],), generator=gen)
        if bool(explore.all()):
            return random
        greedy = self.q(obs.to(self.device)).argmax(dim=1).cpu()
        return torch.where(explore, random, greedy)

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Huber TD loss on a batch (forward only; the caller runs backward).

        With prioritized replay's ``"_weight"`` in the batch, each item's loss is weighted by
        it; :attr:`last_td` holds the batch's ``|TD error|`` (the new priorities).
        """
        obs = batch["obs"]
        n_step = "_return" in batch  # n-step windows: bootstrap from the window's last item
        next_obs = batch["_last_next_obs"] if n_step else batch["next_obs"]
        q = self.learner(obs).gather(1, batch["action"].view(-1, 1)).squeeze(1)
        with torch.no_grad():
            if self.cfg.double_dqn:
                a = self.q(next_obs).argmax(dim=1, keepdim=True)
                nq = self.target(next_obs).gather(1, a).squeeze(1)
            else:
                nq = self.target(next_obs).max(dim=1).values
            if n_step:  # _discount: gamma ** m, 0 when the window ended the episode
                target = batch["_return"] + batch["_discount"] * nq
            else:
                notdone = (~batch["done"]).to(q.dtype)
                target = batch["reward"] + self.cfg.gamma * notdone * nq
        if "_weight" not in batch:
            return F.smooth_l1_loss(q, target)
        self.last_td = (q - target).detach().abs()
        return (F.smooth_l1_loss(q, target, reduction="none") * batch["_weight"]).mean()

    def step(self) -> None:
        """Clip, apply the optimizer step and update the target network."""
        nn.utils.clip_grad_norm_(self.q.parameters(), self.cfg.max_grad_norm)
        self.opt.step()
        if self.flat is not None:
            self.flat.zero_()
        else:
            self.opt.zero_grad(set_to_none=True)
        self.steps += 1
        if self.steps % self.cfg.target_every == 0:
            with torch.no_grad():
                for t, s in zip(self.target.parameters(), self.q.parameters()):
                    t.lerp_(s, self.cfg.tau)

    def state_dict(self) -> dict[str, object]:
        """Networks, optimizer and step counter."""
        return {
            "q": self.q.state_dict(),
            "target": self.target.state_dict(),
            "opt": self.opt.state_dict(),
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore from :meth:`state_dict`."""
        self.q.load_state_dict(state["q"])
        self.target.load_state_dict(state["target"])
        self.opt.load_state_dict(state["opt"])
        self.steps = int(state["steps"])
