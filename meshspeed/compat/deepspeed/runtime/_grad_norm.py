"""DeepSpeed's gradient-norm helpers of `deepspeed.runtime.utils` (`clip_grad_norm_`,
`get_global_norm`), re-exported there; not a DeepSpeed path of its own.

Note [clip_grad_norm_ averages over data parallelism]
DeepSpeed's `clip_grad_norm_` is Megatron's (p-norm summed over the model-parallel group
of an `mpu`, replicated parameters counted on mp rank 0 only) with one addition: the
total is then averaged over the data-parallel group, because expert (MoE) gradients
differ across data-parallel ranks and every rank must clip by the same factor. The
average is taken here too, over `deepspeed.utils.groups`' data-parallel group (the
world before `initialize`); when every rank holds the same gradients it changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from meshspeed import comm
from meshspeed.compat.deepspeed.utils import groups

__all__ = ["clip_grad_norm_", "get_global_norm", "is_model_parallel_parameter"]


def is_model_parallel_parameter(p: torch.Tensor) -> bool:
    """Whether `p` is split over the tensor-parallel group (Megatron's marks)."""
    return bool(getattr(p, "model_parallel", False) or getattr(p, "tensor_model_parallel", False))


def get_global_norm(norm_list: Iterable[float | torch.Tensor]) -> float:
    """The L2 norm of several norms (sqrt of the sum of squares); inf when any of them is
    inf, NaN or negative (an overflow marker)."""
    norms = [float(n) for n in norm_list]
    if any(not math.isfinite(n) or n < 0 for n in norms):
        return float("inf")
    return math.sqrt(sum(n * n for n in norms))


def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2, mpu: Any = None) -> torch.Tensor:
    """Scale the parameters' gradients in place so that their total `norm_type`-norm is at
    most `max_norm`, and return that total norm (before clipping). `mpu` (Megatron-style)
    adds the model-parallel group's pieces; the total is averaged over data parallelism
    (Note [clip_grad_norm_ averages over data parallelism])."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    if not params:
        raise ValueError("clip_grad_norm_(parameters, max_norm): none of the parameters has a "
                         "gradient; call it after backward, with the parameters that were trained")
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"clip_grad_norm_(norm_type=...): expected a positive number or inf, got {norm_type}")
    device = params[0].grad.device
    if norm_type == math.inf:
        total = torch.stack([p.grad.detach().abs().max().float() for p in params])
        total = total.max()
        if mpu is not None:
            comm.all_reduce(total, group=mpu.get_model_parallel_group(), op="max")
    else:
        counted = [p for p in params
                   if mpu is None or mpu.get_model_parallel_rank() == 0 or is_model_parallel_parameter(p)]
        if counted:
            norms = torch.stack([p.grad.detach().float().norm(norm_type) for p in counted])
            total = norms.pow(norm_type).sum()
        else:
            total = torch.zeros((), device=device)
        if mpu is not None:
            comm.all_reduce(total, group=mpu.get_model_parallel_group())
        total = total.pow(1.0 / norm_type)
    if comm.is_initialized():
        dp = groups._get_data_parallel_group()
        total = total / float(comm.get_world_size(dp))
        comm.all_reduce(total, group=dp)
    total = total.to(device)
    coef = torch.clamp(torch.tensor([float(max_norm)], device=device) / (total + 1e-6), max=1.0)
    for p in params:
        p.grad.detach().mul_(coef)
    return total
