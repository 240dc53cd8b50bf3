"""`deepspeed.moe`: DeepSpeed's Mixture-of-Experts package.

meshspeed's own `meshspeed.moe` holds the layer (`deepspeed.moe.layer`, `.experts`,
`.utils` are its modules, found by name: Note [DeepSpeed's paths] in
meshspeed/compat/paths.py). This package adds the modules meshspeed has no core module
for (`sharded_moe`: DeepSpeed's gating functions), and answers the attribute
`deepspeed.moe.<name>` with the mirror's module of that name, else meshspeed.moe's, so
`deepspeed.moe.layer.MoE` works after a bare `import deepspeed` as it did before this
package existed.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    for package in (__name__, "meshspeed.moe"):  # the mirror's module, else meshspeed's
        if importlib.util.find_spec(f"{package}.{name}") is not None:
            module = importlib.import_module(f"{package}.{name}")
            globals()[name] = module
            return module
    raise AttributeError(f"module 'deepspeed.moe' has no attribute {name!r} (meshspeed does not "
                         "provide this part of DeepSpeed's API)")
