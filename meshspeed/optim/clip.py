"""Global gradient norm and clipping over gradients that may be sharded across ranks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from meshspeed import comm


def global_grad_norm(grads: list[torch.Tensor], groups: Sequence[Any] = (),
                     device: torch.device | None = None, *, tp_group: Any = None,
                     tp_split: Sequence[bool] | None = None,
                     norms: torch.Tensor | None = None,
                     weights: Sequence[float] | None = None) -> torch.Tensor:
    """L2 norm of all gradients. `groups`: the groups over which ranks hold disjoint slices
    of the gradients (`StepGradients.groups`, parallel/step.py); the squares are summed over
    each, one scalar all-reduce per group, on `device`: the backend's device, which for
    NCCL is the GPU even when offloaded gradients live on the host. Empty: every rank
    holds all gradients, no collective. `norms`: the gradients' own L2 norms, taken where
    the gradients were (files: Note [gradients in their NVMe slot]), in place of `grads`.

    Note [one norm across tensor-parallel shards]
    With tensor parallelism (`tp_group`), `tp_split[i]` says whether grads[i] belongs to a
    parameter split over the tp group (each tp rank holds a different piece: its squares
    add up over tp) or to one replicated over it (every tp rank holds the same values:
    counted once). Each rank adds its split squares and 1/tp of its replicated squares,
    and one more scalar all-reduce over tp gives every rank the same total.

    `weights[i]`: a factor on grads[i]'s squared norm, for gradients replicated over part
    of `groups` (stage 0 with expert parallelism: dense gradients are replicated over dp,
    expert gradients over edp only; meshspeed/parallel/experts.py)."""
    if norms is None and grads:
        norms = torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])
    if norms is not None and norms.numel():
        norms = norms.square()
        if tp_group is not None:
            tp = comm.get_world_size(tp_group)
            weight = torch.tensor([1.0 if s else 1.0 / tp for s in tp_split], dtype=norms.dtype,
                                  device=norms.device)
            norms = norms * weight
        if weights is not None:
            norms = norms * torch.tensor(list(weights), dtype=norms.dtype, device=norms.device)
        sq = norms.sum()
    else:
        sq = torch.zeros(())
    if tp_group is not None:
        groups = [*groups, tp_group]
    if groups:
        home = sq.device
        sq = sq.to(device or home)
        for group in groups:
            comm.all_reduce(sq, group=group)
        sq = sq.to(home)
    return sq.sqrt()


def clip_coef(max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    """The factor that brings the global norm to at most max_norm (torch's formula)."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


def clip_by_norm_(grads: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale gradients in place so their global norm is at most max_norm (torch's formula)."""
    coef = clip_coef(max_norm, total_norm)
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
