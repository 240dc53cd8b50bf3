"""`deepspeed.launcher.runner`: the names DeepSpeed's launcher module exports that other
tools read (accelerate imports DEEPSPEED_ENVIRONMENT_NAME on every `--use_deepspeed` launch)."""

from __future__ import annotations

import os

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME", "EXPORT_ENVS"]

# the file of NAME=value lines whose variables the launcher exports on every node
DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
EXPORT_ENVS = ["MLFLOW", "PYTHON", "MV2", "UCX"]  # variable prefixes DeepSpeed forwards to the nodes
