"""What `redundancy_clean` does to one layer: write a technique into its weights, and cut.

Writing in (`fix`) keeps the tensors' shapes: quantized values replace the weight,
pruned weights / rows / head columns / channels become zeros. Cutting (`cut_*`) makes new,
smaller tensors: the pruned rows, heads or channels of the pruned layer, and the matching
columns / rows / input channels / features of its related layers. A cut is made only when
the group names related layers: without them the layer's consumer still expects every
output, so the pruned outputs can only be zeros.
"""

from __future__ import annotations

import torch
from torch import nn

from meshspeed.compression.layers import Compressed, Phase
from meshspeed.compression.prune import (
    keep_columns,
    keep_head_columns,
    keep_head_rows,
    keep_rows,
    mask_heads,
)


def _replace(module: nn.Module, name: str, value: torch.Tensor) -> None:
    old = getattr(module, name)
    setattr(module, name, nn.Parameter(value, requires_grad=old.requires_grad))


@torch.no_grad()
def fix_weight_quantization(layer: Compressed) -> None:
    """The weight becomes what an eval forward uses: its quantized (and mixed) values."""
    technique = layer.compression["weight_quantization"]
    layer.weight.copy_(technique.apply(layer.weight, training=False))
    technique.fix()


@torch.no_grad()
def fix_sparse(layer: Compressed) -> None:
    layer.weight.mul_(layer.mask("sparse_pruning"))
    layer.drop_mask("sparse_pruning")
    layer.compression["sparse_pruning"].fix()


@torch.no_grad()
def fix_structured(layer: Compressed, technique: str, cut: bool) -> torch.Tensor:
    """Row / head / channel pruning of `layer`: zeros, or (cut) the pruned units removed.
    Returns the kept units (bool per row / head / channel) for the related layers."""
    mask = layer.mask(technique)
    keep = mask.reshape(-1) > 0
    if technique == "head_pruning":
        if cut:
            _replace(layer, "weight", keep_head_columns(layer.weight, keep))
            layer.in_features = layer.weight.shape[1]
        else:
            layer.weight.copy_(mask_heads(layer.weight, mask))
    elif cut:  # rows of a Linear, output channels of a Conv2d
        _replace(layer, "weight", keep_rows(layer.weight, keep))
        if layer.bias is not None:
            _replace(layer, "bias", keep_rows(layer.bias, keep))
        setattr(layer, "out_features" if isinstance(layer, nn.Linear) else "out_channels",
                layer.weight.shape[0])
    else:
        layer.weight.mul_(mask)
        if layer.bias is not None:
            layer.bias.mul_(mask.reshape(-1))
    layer.drop_mask(technique)
    layer.compression[technique].fix()
    return keep


@torch.no_grad()
def cut_related(module: nn.Module, technique: str, keep: torch.Tensor, name: str) -> None:
    """Shrink a layer fed by (or, for heads, feeding) a pruned one, to match its cut."""
    _check_unmasked(module, name)
    if technique == "head_pruning":  # Q/K/V: rows grouped by head
        if module.out_features % keep.numel():
            raise ValueError(f"{name}: {module.out_features} outputs do not split into "
                             f"{keep.numel()} heads; related_modules of head_pruning are Q/K/V")
        _replace(module, "weight", keep_head_rows(module.weight, keep))
        if module.bias is not None:
            _replace(module, "bias", keep_head_rows(module.bias, keep))
        module.out_features = module.weight.shape[0]
    elif isinstance(module, nn.BatchNorm2d):
        _expect(module.num_features, keep, name, "features")
        if module.affine:
            _replace(module, "weight", keep_rows(module.weight, keep))
            _replace(module, "bias", keep_rows(module.bias, keep))
        if module.running_mean is not None:
            module.running_mean = keep_rows(module.running_mean, keep)
            module.running_var = keep_rows(module.running_var, keep)
        module.num_features = int(keep.sum())
    elif isinstance(module, nn.Conv2d):
        if module.groups != 1:
            raise ValueError(f"{name}: a grouped convolution (groups={module.groups}) cannot lose "
                             "input channels one by one")
        _expect(module.in_channels, keep, name, "input channels")
        _replace(module, "weight", keep_columns(module.weight, keep))
        module.in_channels = module.weight.shape[1]
    else:  # Linear: input columns
        _expect(module.in_features, keep, name, "input features")
        _replace(module, "weight", keep_columns(module.weight, keep))
        module.in_features = module.weight.shape[1]


def _expect(size: int, keep: torch.Tensor, name: str, what: str) -> None:
    if size != keep.numel():
        raise ValueError(f"{name}: has {size} {what} but its pruned partner has {keep.numel()} "
                         "outputs; related_modules must name the layers its outputs feed")


def _check_unmasked(module: nn.Module, name: str) -> None:
    # a mask shaped like the old weight would no longer fit it (cleaning goes in DeepSpeed's
    # order, so weight quantization and sparse pruning are written in before any cut)
    if isinstance(module, Compressed):
        for technique in ("weight_quantization", "sparse_pruning", "head_pruning"):
            t = module.compression.get(technique)
            if t is not None and t.phase is not Phase.FIXED:
                raise ValueError(f"{name}: still has {technique} pending, so it cannot be cut as a "
                                 "related layer; do not prune a layer related to its own partner")
