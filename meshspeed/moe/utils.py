"""DeepSpeed's MoE parameter-group helpers, with DeepSpeed's meaning.

A parameter is an expert (MoE) parameter when it is marked ``allreduce=False`` (its
gradient is averaged over its expert-data-parallel group, named by ``group_name``, not
over all data-parallel ranks) -- the mark DeepSpeed's MoE layers put on expert weights.
meshspeed's own modules never set it, so without MoE layers no parameter is an expert
parameter and `split_params_into_different_moe_groups_for_optimizer` returns the groups
unchanged (as a list).
"""

from __future__ import annotations

from typing import Any

import torch

from meshspeed.moe.layer import MoE

__all__ = ["is_moe_param", "is_moe_param_group", "split_params_into_different_moe_groups_for_optimizer"]

DEFAULT_MAX_GROUP_SIZE = 178956971  # DeepSpeed's default: elements per expert parameter group


def is_moe_param(param: torch.Tensor) -> bool:
    return getattr(param, "allreduce", True) is False


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    return bool(param_group.get("moe", False))


def split_params_into_different_moe_groups_for_optimizer(
        param_groups: dict[str, Any] | tuple[dict[str, Any], ...] | list[dict[str, Any]],
        max_group_size: float | None = DEFAULT_MAX_GROUP_SIZE) -> list[dict[str, Any]]:
    """The groups with expert parameters moved out into groups of their own.

    Each input group keeps its options and its non-expert parameters (the same dict
    objects are returned, their "params" made lists); for each expert group name found in
    it, a new group copies its options with ``name`` set to that group name, ``moe=True``
    and the expert parameters, split into chunks of at most `max_group_size` elements."""
    if isinstance(param_groups, dict):
        groups = [param_groups]
    elif isinstance(param_groups, list | tuple):
        groups = list(param_groups)
    else:
        raise TypeError(f"param_groups: expected a dict or a list/tuple of dicts, got {type(param_groups).__name__}")
    expert_groups = []
    for group in groups:
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        by_name: dict[str, list[torch.Tensor]] = {}
        for p in params:
            if is_moe_param(p):
                by_name.setdefault(getattr(p, "group_name", "ep_default"), []).append(p)
        group["params"] = [p for p in params if not is_moe_param(p)]
        for name, experts in by_name.items():
            for chunk in _chunks(experts, max_group_size):
                expert_groups.append({**group, "name": name, "moe": True, "params": chunk})
    return groups + expert_groups


def _chunks(params: list[torch.Tensor], limit: float | None) -> list[list[torch.Tensor]]:
    if limit is None:
        return [params]
    chunks, current, size = [], [], 0
    for p in params:
        if current and size + p.numel() > limit:
            chunks.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel()
    return chunks + ([current] if current else [])


def expert_layers(module: torch.nn.Module) -> list[tuple[str, Any]]:
    """(name, layer) of every `MoE` layer below `module`."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, MoE)]


def global_expert_names(module: torch.nn.Module, ep_rank: int) -> dict[int, str]:
    """id(param) -> the parameter's name with its GLOBAL expert id, for every expert
    parameter of `module`'s MoE layers: local expert i of ep rank r is global expert
    r * num_local_experts + i (layer.py). Checkpoints name expert parameters this way, so
    the ep ranks' experts get distinct names and a checkpoint reads back at any ep size."""
    out: dict[int, str] = {}
    for name, layer in expert_layers(module):
        local = layer.num_local_experts
        prefix = f"{name}.deepspeed_moe.experts.deepspeed_experts." if name else \
            "deepspeed_moe.experts.deepspeed_experts."
        for i, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            for rest, p in expert.named_parameters():
                out[id(p)] = f"{prefix}{ep_rank * local + i}.{rest}"
    return out
