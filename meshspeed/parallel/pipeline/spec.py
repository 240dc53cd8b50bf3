"""Layers to build later: `LayerSpec` and `TiedLayerSpec`, DeepSpeed's lazy pipeline layers.

A spec names a module class and its arguments; the PipelineModule builds it only on the
stage that owns it (Note [only the owner builds] in module.py), and partition.py counts
its parameters on the meta device to cut the stages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

__all__ = ["LayerSpec", "TiedLayerSpec"]


class LayerSpec:
    """A layer to build later: ``LayerSpec(nn.Linear, 8, 16, bias=False).build()``."""

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec needs an nn.Module class, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        del log  # DeepSpeed logs each build; nothing here is worth a line per layer
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{type(self).__name__}({self.typename.__name__}, {', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A layer shared by every position that names the same `key`.

    `forward_fn(module, x)`, when given, is what that position computes with the shared
    module (e.g. the output projection through a tied embedding's weight).
    `tied_weight_attr` names the tied tensors (Note [tied layers across stages])."""

    def __init__(self, key: str, typename: type[nn.Module], *module_args: Any,
                 forward_fn: Callable[[nn.Module, Any], Any] | None = None,
                 tied_weight_attr: str | Sequence[str] = "weight", **module_kwargs: Any):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
