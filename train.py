"""Main job: DQN (or PPO, ``algo=ppo``; or GRPO on a small language model, ``algo=grpo``)
through the conduit_dist data plane.

torchrun --standalone --nproc_per_node=2 train.py experiment=smoke
torchrun --standalone --nproc_per_node=2 train.py experiment=cartpole_ppo
torchrun --standalone --nproc_per_node=2 train.py experiment=grpo
torchrun --standalone --nproc_per_node=2 train.py experiment=grpo mode=disaggregated \
    algo.grpo.generators=attached algo.grpo.attach_dir=runs/gen   # then, any time, generators:
python train.py experiment=grpo algo.grpo.role=generator algo.grpo.attach_dir=runs/gen
torchrun --standalone --nproc_per_node=2 train.py experiment=smoke mode=disaggregated \
    algo.actors=attached algo.attach_dir=runs/act   # then, any time, DQN actors:
python train.py experiment=smoke algo.role=actor algo.attach_dir=runs/act
python train.py                       # world size 1
python train.py device=cuda           # on a GPU (torchrun: one GPU per rank, cuda:<LOCAL_RANK>)

Needs the ``[train]`` extra: ``pip install -e ".[train]"``.
"""

from __future__ import annotations

import sys

import conduit_dist as cd
from conduit_dist.extras import require
from conduit_dist.logging import log_rank_zero

with require("train", "train.py"):  # hydra-core, omegaconf, gymnasium (wandb, tqdm: on use)
    import hydra
    from omegaconf import DictConfig, OmegaConf

    from conduit_dist.train import setup
    from conduit_dist.train.config import TrainConfig, register, validate
    from conduit_dist.train.dqn_actor import DQNActor
    from conduit_dist.train.grpo_generator import GRPOGenerator
    from conduit_dist.train.grpo_trainer import GRPOTrainer
    from conduit_dist.train.launch import prepare_hydra_argv
    from conduit_dist.train.metrics import make_logger
    from conduit_dist.train.ppo_trainer import PPOTrainer
    from conduit_dist.train.resume import run_id
    from conduit_dist.train.trainer import Trainer, write_summary

register()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(dcfg: DictConfig) -> None:
    """Compose, initialise, build, run, close (also on failure)."""
    cfg: TrainConfig = OmegaConf.to_object(dcfg)
    validate(cfg)
    if cfg.algo.name == "grpo" and cfg.algo.grpo.role == "generator":  # outside the job
        summary = GRPOGenerator(cfg).run()
        log_rank_zero("done: %s", summary)
        return
    if cfg.algo.role == "actor":  # a DQN actor outside the job
        summary = DQNActor(cfg).run()
        log_rank_zero("done: %s", summary)
        return
    device = setup.device(cfg)  # once, before anything is built: no CUDA here fails now
    run_dir = hydra.core.hydra_config.HydraConfig.get().runtime.output_dir
    cd.init_distributed(device=device, timeout_s=cfg.plane.timeout_s)
    logger = trainer = None
    try:
        logger = make_logger(
            cfg.logger.kind,
            cfg.logger.mode,
            cfg.logger.project,
            cfg.total_env_steps,
            OmegaConf.to_container(dcfg, resolve=True),
            run_dir,
            run_id(cfg.checkpoint) if cd.is_rank_zero() else None,
        )
        kind = {"ppo": PPOTrainer, "grpo": GRPOTrainer}.get(cfg.algo.name, Trainer)
        trainer = kind(cfg, logger, device)
        summary = trainer.run()
        log_rank_zero("done: %s", {k: summary[k] for k in kind.DONE_KEYS})
        if cfg.logger.summary_path and trainer.rank == 0:
            write_summary(cfg.logger.summary_path, summary)
    finally:
        if trainer is not None:
            trainer.close()
        if logger is not None:
            logger.close()
        cd.destroy_distributed()


if __name__ == "__main__":
    sys.argv = prepare_hydra_argv(sys.argv)
    main()
