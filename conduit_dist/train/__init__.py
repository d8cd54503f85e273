"""The training job behind ``train.py``: config schemas, Hydra launch, metrics, progress, the
DQN and PPO trainers and the plane they ask for, resume."""
