"""Process-level runtime: accelerator, starting torch.distributed, `meshspeed run` / `env`."""

from meshspeed.runtime.accelerator import Accelerator, get_accelerator
from meshspeed.runtime.distributed import (
    LaunchEnv,
    describe_world,
    detect_launch_env,
    get_local_rank,
    init_distributed,
)

__all__ = [
    "Accelerator",
    "LaunchEnv",
    "describe_world",
    "detect_launch_env",
    "get_accelerator",
    "get_local_rank",
    "init_distributed",
]
