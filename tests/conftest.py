"""Shared fixtures: tests run on CPU with real gloo groups; W&B is disabled."""

import os

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("OMP_NUM_THREADS", "1")
