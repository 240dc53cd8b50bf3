"""`deepspeed`, as meshspeed answers it: DeepSpeed's top-level names over meshspeed's objects.

Under the alias (`meshspeed compat install`, `meshspeed run --deepspeed-compat`) this module
is `sys.modules["deepspeed"]`; its subpackages mirror DeepSpeed's module tree, and a path the
mirror lacks falls through to meshspeed's own package of that name (Note [DeepSpeed's paths]
in meshspeed/compat/paths.py). Everything is imported on first use.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from meshspeed.version import DEEPSPEED_VERSION
from meshspeed.version import __version__ as _meshspeed_version

__version__ = DEEPSPEED_VERSION
# what DeepSpeed's build records; the same values as git_version_info's git_hash / git_branch
__git_hash__ = f"meshspeed-{_meshspeed_version}"
__git_branch__ = "meshspeed"
__version_major__, __version_minor__, __version_patch__ = (int(n) for n in __version__.split("+")[0].split("."))

# DeepSpeed's top-level names: name -> (module, attribute); a subpackage of the mirror or of
# meshspeed (`deepspeed.moe`, `deepspeed.runtime`) is found by name instead
_NAMES = {
    "initialize": ("meshspeed.compat.api", "initialize"),
    "tp_model_init": ("meshspeed.compat.api", "tp_model_init"),
    "set_autotp_mode": ("meshspeed.compat.api", "set_autotp_mode"),
    "init_distributed": ("meshspeed.process.distributed", "init_distributed"),
    "init_inference": ("meshspeed.inference.engine", "init_inference"),
    "add_config_arguments": ("meshspeed.compat.deepspeed.arguments", "add_config_arguments"),
    "DeepSpeedEngine": ("meshspeed.compat.deepspeed.runtime.engine", "DeepSpeedEngine"),
    "PipelineEngine": ("meshspeed.compat.deepspeed.runtime.pipe.engine", "PipelineEngine"),
    "PipelineModule": ("meshspeed.compat.deepspeed.pipe", "PipelineModule"),
    "get_accelerator": ("meshspeed.process.accelerator", "get_accelerator"),
    "ConfigError": ("meshspeed.config.errors", "ConfigError"),
    "DeepSpeedConfig": ("meshspeed.compat.deepspeed.runtime.config", "DeepSpeedConfig"),
    "DeepSpeedConfigError": ("meshspeed.compat.deepspeed.runtime.config", "DeepSpeedConfigError"),
}


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    if name in _NAMES:
        module, attr = _NAMES[name]
        value = getattr(importlib.import_module(module), attr)
    else:
        value = None
        for package in (__name__, "meshspeed"):  # the mirror's subpackage, else meshspeed's
            if importlib.util.find_spec(f"{package}.{name}") is not None:
                value = importlib.import_module(f"{package}.{name}")
                break
        if value is None:
            raise AttributeError(f"module 'deepspeed' has no attribute {name!r} (meshspeed does not "
                                 "provide this part of DeepSpeed's API)")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_NAMES})
