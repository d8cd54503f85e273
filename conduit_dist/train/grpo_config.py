"""``algo=grpo``'s settings (``algo.grpo``) and the checks of a GRPO run's config.

The task, the model and the update are ``conduit_dist/rl/grpo.py``, ``rl/lm.py`` and
``rl/grpo_update.py``; ``train/grpo_trainer.py`` runs them through a ``cd.TokenPlane``. Of the
``algo`` fields GRPO reads ``lr`` and ``max_grad_norm`` besides ``grpo``; of ``plane`` the
transport settings (``timeout_s``, ``strategy``, ``calibrate``, ``latency_us``, ``gbps``,
``bandwidth_cache``). ``total_env_steps`` counts scored responses trained on (each step trains
``prompts_per_step x group_size``); ``target_return`` is a target mean reward of the last 100.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from conduit_dist.errors import ConfigError
from conduit_dist.rl.grpo import GRPOConfig

if TYPE_CHECKING:
    from conduit_dist.train.config import TrainConfig


@dataclass
class GRPOSettings:
    """GRPO on the digit-reversal task (``algo=grpo``; docs/grpo.md).

    Attributes:
        max_digits: the longest prompt digit string.
        max_new: the most tokens a response may have.
        group_size: responses per prompt (a prompt group, ``G``).
        prompts_per_step: groups in a global batch: one optimiser step per epoch, one policy
            version (the plane's ``groups_per_batch``).
        epochs: passes over each global batch, one optimiser step each (the first streamed,
            the others over the micro-batches the learner kept).
        clip: PPO ratio clip.
        kl_coef: k3 KL penalty to the initial policy (0: off). 0.04 (DeepSeekMath's beta): it
            keeps the policy from collapsing onto deterministic wrong answers, whose groups
            have equal rewards and so no advantage to learn from (docs/grpo.md).
        adv_eps: added to a group's reward std before dividing.
        token_budget: the most tokens per micro-batch on each learner (a memory bound:
            gradients accumulate over the step).
        gen_groups: groups a producer generates per call of the model (a chunk between two
            rounds).
        max_policy_age: the bound on a consumed token's policy age; producers are paced by it
            (``reserve``), nothing is dropped.
        stream: learners train on micro-batches as groups complete (``stream``); ``false``
            waits for the whole global batch (``fetch``).
        max_minutes: stop after this much wall time (0: only ``total_env_steps``).
        wait_s: how long a learner waits for a global batch before failing.
        d_model, n_layers, n_heads: the policy's size (``rl/lm.py``'s ``LMConfig``).
        eval_prompts: held-out prompts, never drawn for training, answered greedily before
            the first step, every ``eval_every`` global batches and after the last
            (``rl/grpo_eval.py``; split over the learners).
        eval_every: global batches between evaluations (0: the first and the last only).
        eval_seed: the held-out set's own seed (the same set whatever the run's seed).
        generators: ``ranks`` (the job's producer ranks generate) or ``attached`` (with
            ``mode=disaggregated``: every rank learns and opens an ingress in ``attach_dir``;
            generators are processes outside the job, ``role=generator``; docs/attach.md).
        attach_dir: the run directory of the ingresses (``generators=attached`` and
            ``role=generator``).
        role: ``job`` (``torchrun ... train.py``) or ``generator`` (``python train.py ...
            algo.grpo.role=generator``: one generator attaching to ``attach_dir``).
    """

    max_digits: int = 6
    max_new: int = 8
    group_size: int = 16
    prompts_per_step: int = 8
    epochs: int = 1
    clip: float = 0.2
    kl_coef: float = 0.04
    adv_eps: float = 1e-4
    token_budget: int = 2048
    gen_groups: int = 2
    max_policy_age: int = 1
    stream: bool = True
    max_minutes: float = 0.0
    wait_s: float = 300.0
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    eval_prompts: int = 256
    eval_every: int = 500
    eval_seed: int = 1234
    generators: str = "ranks"
    attach_dir: str | None = None
    role: str = "job"

    def to_config(self, lr: float, grad_clip: float, seed: int) -> GRPOConfig:
        """The algorithm's config (``rl/grpo.py``) from these settings.

        Args:
            lr: ``algo.lr``.
            grad_clip: ``algo.max_grad_norm``.
            seed: the run's seed.

        Returns:
            The :class:`GRPOConfig` the update and the task read.
        """
        shared = ("max_digits", "group_size", "prompts_per_step", "max_new", "clip", "epochs",
                  "token_budget", "kl_coef", "adv_eps")  # fmt: skip
        return GRPOConfig(
            **{k: getattr(self, k) for k in shared}, lr=lr, grad_clip=grad_clip, seed=seed
        )


def check_attach(cfg: TrainConfig) -> None:
    """Refuse attach settings that do not go together, naming each.

    Raises:
        ConfigError: naming the field, the expected and the received value.
    """
    from conduit_dist import registry

    g = cfg.algo.grpo
    registry.check_choice("algo.grpo.generators", g.generators, registry.GRPO_GENERATORS)
    registry.check_choice("algo.grpo.role", g.role, registry.GRPO_ROLES)
    needs_dir = g.generators == "attached" or g.role == "generator"
    if needs_dir and not g.attach_dir:
        raise ConfigError(
            "algo.grpo.attach_dir: expected the ingresses' run directory with "
            f"generators=attached or role=generator, got {g.attach_dir!r}"
        )
    if g.generators == "attached" and cfg.mode != "disaggregated":
        raise ConfigError(
            f"mode: expected disaggregated with algo.grpo.generators=attached (every rank of "
            f"the job learns, generators attach from outside), got {cfg.mode!r}"
        )


def check_grpo(cfg: TrainConfig, world: int, learners: list[int]) -> None:
    """Refuse the settings a GRPO run cannot honour, naming each.

    Args:
        cfg: the run config (``algo.name == "grpo"``).
        world: the number of ranks.
        learners: the learner ranks.

    Raises:
        ConfigError: naming the field, the expected and the received value.
    """
    check_attach(cfg)
    g, pc = cfg.algo.grpo, cfg.plane
    positive = ("max_digits", "max_new", "group_size", "prompts_per_step", "epochs")
    sizes = ("token_budget", "gen_groups", "d_model", "n_layers", "n_heads", "eval_prompts")
    for name in (*positive, *sizes):
        if getattr(g, name) < 1:
            raise ConfigError(f"algo.grpo.{name}: expected >= 1, got {getattr(g, name)!r}")
    if g.group_size < 2:
        raise ConfigError(
            f"algo.grpo.group_size: expected >= 2 (advantages are normalised within a "
            f"group), got {g.group_size}"
        )
    for name in ("max_policy_age", "eval_every"):
        if getattr(g, name) < 0:
            raise ConfigError(f"algo.grpo.{name}: expected >= 0, got {getattr(g, name)!r}")
    for name in ("max_minutes", "kl_coef", "adv_eps"):
        if getattr(g, name) < 0:
            raise ConfigError(f"algo.grpo.{name}: expected >= 0, got {getattr(g, name)!r}")
    if g.wait_s <= 0:
        raise ConfigError(f"algo.grpo.wait_s: expected > 0, got {g.wait_s!r}")
    if g.d_model % g.n_heads:
        raise ConfigError(
            f"algo.grpo.d_model: expected a multiple of n_heads={g.n_heads}, got {g.d_model}"
        )
    attached = g.generators == "attached"
    producers = world if cfg.mode == "colocated" else world - len(learners)
    if attached:
        producers = 0  # outside the job: not paced by the plane's windows
    if g.prompts_per_step < max(len(learners), producers):
        raise ConfigError(
            f"algo.grpo.prompts_per_step: expected >= {max(len(learners), producers)} (a group "
            f"for each of {len(learners)} learners and each of {producers} producers), got "
            f"{g.prompts_per_step}"
        )
    window = (g.max_policy_age + 1) * (g.prompts_per_step // max(producers, 1))
    if g.gen_groups > window:
        raise ConfigError(
            f"algo.grpo.gen_groups: expected <= {window} (a producer's share of "
            f"prompts_per_step x (max_policy_age + 1)), got {g.gen_groups}"
        )
    refused = [
        ("plane.kind", pc.kind, "conduit", "GRPO runs through the token plane"),
        ("plane.sampler", pc.sampler, "auto", "the token plane delivers whole groups once"),
        ("plane.tiers", pc.tiers, None, "the token plane has one host memory tier"),
        ("plane.early_start", pc.early_start is True, False, "DQN only"),
        ("checkpoint.dir", cfg.checkpoint.dir, None, "GRPO resume is not built yet"),
    ]
    for name, got, expected, why in refused:
        if got != expected:
            raise ConfigError(
                f"{name}: expected {expected!r} with algo=grpo ({why}; use "
                f"experiment=grpo), got {got!r}"
            )
    if cfg.algo.lr <= 0 or cfg.algo.max_grad_norm < 0:
        raise ConfigError(
            f"algo.lr / algo.max_grad_norm: expected > 0 / >= 0 (0: no clipping), got "
            f"{cfg.algo.lr!r} / {cfg.algo.max_grad_norm!r}"
        )
    if pc.trace_dir is not None:
        raise ConfigError(
            f"plane.trace_dir: expected None with algo=grpo (the token plane writes no Chrome "
            f"trace yet), got {pc.trace_dir!r}"
        )
    if cfg.algo.grad_sync != "auto":
        raise ConfigError(
            f"algo.grad_sync: expected 'auto' with algo=grpo (its learners average the "
            f"accumulated gradient in one all_reduce per global batch), got "
            f"{cfg.algo.grad_sync!r}"
        )
    if pc.placement not in ("auto", "local"):
        raise ConfigError(
            f"plane.placement: expected auto or local with algo=grpo (a group stays on its "
            f"producer's shard until a learner takes it), got {pc.placement!r}"
        )
