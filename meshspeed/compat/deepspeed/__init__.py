"""`deepspeed`, as meshspeed answers it: DeepSpeed's top-level names over meshspeed's objects.

Under the alias (`meshspeed compat install`, `meshspeed run --deepspeed-compat`) this module
is `sys.modules["deepspeed"]`; its subpackages mirror DeepSpeed's module tree, and a path the
mirror lacks falls through to meshspeed's own package of that name (Note [DeepSpeed's paths]
in meshspeed/compat/paths.py). Everything is imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

import meshspeed

__version__ = meshspeed.__version__

# DeepSpeed's top-level names that are not meshspeed's: name -> (module, attribute)
_NAMES = {
    "DeepSpeedEngine": ("meshspeed.compat.deepspeed.runtime.engine", "DeepSpeedEngine"),
    "PipelineEngine": ("meshspeed.compat.deepspeed.runtime.pipe.engine", "PipelineEngine"),
}


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    if name in _NAMES:
        module, attr = _NAMES[name]
        value = getattr(importlib.import_module(module), attr)
    elif importlib.util.find_spec(f"{__name__}.{name}") is not None:  # a mirrored subpackage
        value = importlib.import_module(f"{__name__}.{name}")
    else:  # meshspeed's own public name or package (`deepspeed.initialize`, `deepspeed.moe`)
        value = getattr(meshspeed, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_NAMES, *dir(meshspeed)})
