"""meshspeed: the DeepSpeed system, rebuilt cleanly on PyTorch.

Public API only. Heavy submodules are imported lazily so that `import meshspeed` stays
cheap and `import meshspeed as deepspeed` works in existing training scripts.
"""

from __future__ import annotations

import importlib
from typing import Any

from meshspeed.compat.paths import install_meshspeed_names
from meshspeed.version import __version__

install_meshspeed_names()  # Note [DeepSpeed's paths]: meshspeed.zero, meshspeed.runtime, ...

# public name -> (module, attribute)
_LAZY = {
    "initialize": ("meshspeed.compat.api", "initialize"),
    "MeshspeedEngine": ("meshspeed.engine.engine", "MeshspeedEngine"),
    "DeepSpeedEngine": ("meshspeed.compat.deepspeed.runtime.engine", "DeepSpeedEngine"),
    "init_distributed": ("meshspeed.process.distributed", "init_distributed"),
    "ConfigError": ("meshspeed.config.errors", "ConfigError"),
    "DivergenceError": ("meshspeed.engine.agreement", "DivergenceError"),
    "estimate_memory": ("meshspeed.planner.estimate", "estimate_memory"),
    "init_inference": ("meshspeed.inference.engine", "init_inference"),
    "apply_tensor_parallel": ("meshspeed.tensor_parallel.apply", "apply_tensor_parallel"),
    "tp_model_init": ("meshspeed.compat.api", "tp_model_init"),
    "set_autotp_mode": ("meshspeed.compat.api", "set_autotp_mode"),
    "zero": ("meshspeed.zero", None),
    "comm": ("meshspeed.comm", None),
    "checkpoint": ("meshspeed.checkpoint", None),
    "checkpointing": ("meshspeed.checkpointing", None),
    "accelerator": ("meshspeed.accelerator", None),
    "utils": ("meshspeed.utils", None),
    "add_config_arguments": ("meshspeed.arguments", "add_config_arguments"),
    "get_accelerator": ("meshspeed.process.accelerator", "get_accelerator"),
    # DeepSpeed's other top-level names and the packages scripts reach as attributes
    # (`deepspeed.runtime.utils.set_random_seed`, `deepspeed.moe.layer.MoE`)
    "PipelineModule": ("meshspeed.pipe", "PipelineModule"),
    "runtime": ("meshspeed.runtime", None),
    "pipe": ("meshspeed.pipe", None),
    "moe": ("meshspeed.moe", None),
    "ops": ("meshspeed.ops", None),
    "compression": ("meshspeed.compression", None),
}

__all__ = ["__version__", *_LAZY.keys()]  # noqa: PLE0604 - names listed in _LAZY


def __getattr__(name: str) -> Any:
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'meshspeed' has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
