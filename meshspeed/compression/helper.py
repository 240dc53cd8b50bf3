"""`deepspeed.compression.helper.recursive_getattr / recursive_setattr` (DeepSpeed-Chat's LoRA
code replaces sub-modules with them)."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["recursive_getattr", "recursive_setattr"]


def recursive_getattr(model: nn.Module, module_name: str) -> Any:
    """``recursive_getattr(model, "encoder.layer.0")`` is ``model.encoder.layer[0]``."""
    obj = model
    for part in module_name.split("."):
        obj = getattr(obj, part)
    return obj


def recursive_setattr(model: nn.Module, module_name: str, module: Any) -> None:
    """Replace the attribute at dotted path `module_name` with `module`."""
    parent, _, leaf = module_name.rpartition(".")
    setattr(recursive_getattr(model, parent) if parent else model, leaf, module)
