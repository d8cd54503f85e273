"""GRPO's update, shared by the single-process reference and ``train.py algo=grpo``.

One optimiser step per global batch of prompt groups: each micro-batch's loss is summed over
its response tokens and backpropagated (gradients accumulate in one flat buffer), and the step
divides the accumulated gradient by the batch's response tokens over every learner, so the
update is the token mean of the clipped surrogate over the whole global batch whatever the
micro-batches, their order or the number of learners. With several learners the flat gradient
and the token count travel in one ``all_reduce`` on the learners' group.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from conduit_dist.rl.grpo import GRPOConfig, micro_batch_loss
from conduit_dist.rl.lm import TinyLM

STATS = ("pg", "kl", "clipfrac", "ratio")


class GRPOUpdate:
    """Gradient accumulation over micro-batches and one Adam step per global batch.

    Args:
        policy: the policy being trained (its parameters on one device).
        cfg: hyperparameters (``lr``, ``clip``, ``kl_coef``, ``grad_clip``).
        group: the learners' process group (``None``: this process is the only learner).
        ref: frozen reference policy for the KL penalty (when ``cfg.kl_coef > 0``).

    Raises:
        ValueError: ``cfg.kl_coef > 0`` without ``ref``.
    """

    def __init__(
        self,
        policy: TinyLM,
        cfg: GRPOConfig,
        group: dist.ProcessGroup | None = None,
        ref: TinyLM | None = None,
    ) -> None:
        if cfg.kl_coef > 0 and ref is None:
            raise ValueError("GRPOUpdate: kl_coef > 0 needs a reference policy")
        self.policy, self.cfg, self.group, self.ref = policy, cfg, group, ref
        params = [p for p in policy.parameters() if p.requires_grad]
        n = sum(p.numel() for p in params)
        dev, dtype = params[0].device, params[0].dtype
        # the gradients as views of one buffer, the response-token count in its last slot
        self.buf = torch.zeros(n + 1, device=dev, dtype=dtype)
        at = 0
        for p in params:
            p.grad = self.buf[at : at + p.numel()].view_as(p)
            at += p.numel()
        self.params = params
        self.opt = torch.optim.Adam(params, lr=cfg.lr)
        self._stats = torch.zeros(len(STATS), dtype=torch.float64)  # this learner's, summed
        self._mbs = 0
        self._tokens = 0.0  # this learner's response tokens since the last step

    def accumulate(
        self, fields: Mapping[str, torch.Tensor], cu_seqlens: torch.Tensor, max_seqlen: int
    ) -> None:
        """Backpropagate one packed micro-batch's summed loss into the flat gradient.

        Args:
            fields: packed ``tokens``, ``logprobs``, ``loss_mask``, ``advantage``.
            cu_seqlens: ``[n + 1]`` cumulative lengths.
            max_seqlen: the longest sequence.
        """
        loss, stats = micro_batch_loss(
            self.policy, fields, cu_seqlens, max_seqlen, self.cfg, self.ref, denom=1.0
        )
        loss.backward()
        n = fields["loss_mask"].sum()
        self.buf[-1] += n
        self._tokens += float(n)
        self._stats += torch.tensor([stats[k] for k in STATS], dtype=torch.float64)
        self._mbs += 1

    def step(self) -> dict[str, float]:
        """Average over every learner's response tokens, clip, take the Adam step, zero.

        Returns:
            ``tokens`` (the global batch's response tokens), ``grad_norm`` (before clipping),
            ``micro_batches`` (this learner's), ``pg`` and ``kl`` per response token of this
            learner's micro-batches, ``clipfrac`` and ``ratio`` (means over them).

        Raises:
            RuntimeError: when a parameter's ``.grad`` was replaced or reset.
        """
        at = 0
        for p in self.params:  # the views backward accumulates into: reset means lost grads
            if p.grad is None or p.grad.data_ptr() != self.buf[at:].data_ptr():
                raise RuntimeError(
                    "GRPOUpdate: a parameter's .grad is no longer a view of the flat buffer "
                    "(was zero_grad(set_to_none=True) called?); the update owns the gradients"
                )
            at += p.numel()
        if self.group is not None:
            dist.all_reduce(self.buf, group=self.group)
        tokens = float(self.buf[-1])
        self.buf[:-1] /= max(tokens, 1.0)
        norm = (
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
            if self.cfg.grad_clip > 0
            else self.buf[:-1].norm()
        )
        self.opt.step()
        self.buf.zero_()
        pg, kl, clipfrac, ratio = self._stats.tolist()
        mbs, own = max(self._mbs, 1), max(self._tokens, 1.0)
        out = {"pg": pg / own, "kl": kl / own, "clipfrac": clipfrac / mbs, "ratio": ratio / mbs}
        out.update(tokens=tokens, grad_norm=float(norm), micro_batches=self._mbs)
        self._stats.zero_()
        self._mbs, self._tokens = 0, 0.0
        return out
