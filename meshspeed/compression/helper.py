"""`deepspeed.compression.helper`: module-path utilities (DeepSpeed-Chat's LoRA code
replaces sub-modules with them) and `convert_conv1d_to_linear`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["convert_conv1d_to_linear", "recursive_getattr", "recursive_setattr"]


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


@torch.no_grad()
def convert_conv1d_to_linear(model: nn.Module, convert_type: type) -> nn.Module:
    """Replace every `convert_type` layer (Hugging Face GPT-2's `Conv1D`, weight (in, out))
    by the `nn.Linear` computing the same (weight (out, in)), so compression can wrap it."""
    inner = getattr(model, "module", None)
    target = inner if isinstance(inner, nn.Module) else model
    for name, old in list(target.named_modules()):
        if not isinstance(old, convert_type):
            continue
        w = old.weight
        new = nn.Linear(w.shape[0], w.shape[1], bias=old.bias is not None, device=w.device,
                        dtype=w.dtype)
        new.weight.copy_(w.t())
        if old.bias is not None:
            new.bias.copy_(old.bias.reshape(-1))
        recursive_setattr(target, name, new)
    return model
