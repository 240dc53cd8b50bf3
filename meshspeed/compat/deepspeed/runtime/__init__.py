"""`deepspeed.runtime`: DeepSpeed's runtime package path. Its submodules (`utils`, `zero`,
`pipe`, `lr_schedules`, ...) are imported the first time a script reaches them as attributes."""

import importlib
import importlib.util

from meshspeed.process.accelerator import Accelerator, get_accelerator
from meshspeed.process.distributed import (
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


def __getattr__(name: str):
    # DeepSpeed scripts write `deepspeed.runtime.utils.set_random_seed(...)` after only
    # `import deepspeed`: a submodule is imported the first time it is reached this way.
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
