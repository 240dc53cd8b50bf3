"""DeepSpeed's Adam classes, `FusedAdam` and `DeepSpeedCPUAdam`, as torch's Adam.

Scripts build them over the model's parameters and pass them to `initialize(optimizer=...)`
(DeepSpeed-Chat: ``DeepSpeedCPUAdam if offload else FusedAdam``). Both take DeepSpeed's
constructor arguments and mean what DeepSpeed means (Note [Adam means AdamW] in
builder.py): decoupled weight decay unless `adam_w_mode` / `adamw_mode` is false, in which
case the decay is an L2 term added to the gradient. The arithmetic is torch's
`torch.optim.Adam` (with `decoupled_weight_decay`), using torch's fused kernel where every
parameter allows it; DeepSpeed's own CUDA / AVX kernels compute the same update.

DeepSpeed's `bias_correction=False` has no torch counterpart and is refused rather than
silently replaced by the bias-corrected update; so is `amsgrad`, which DeepSpeed refuses too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


def _materialised(params: Iterable[Any]) -> list[Any]:
    """Parameters or groups as lists, so that they can be read here and again by torch
    (scripts pass generators: `model.parameters()`, groups built with comprehensions)."""
    out = []
    for p in params:
        if isinstance(p, dict) and not isinstance(p["params"], torch.Tensor):
            p = {**p, "params": list(p["params"])}
        out.append(p)
    return out


def _fused_ok(params: list[Any]) -> bool:
    """Whether torch's fused Adam kernel accepts every parameter (floating, CPU or CUDA)."""
    tensors = []
    for p in params:
        group = p["params"] if isinstance(p, dict) else p
        tensors.extend([group] if isinstance(group, torch.Tensor) else group)
    return bool(tensors) and all(t.is_floating_point() and t.device.type in ("cpu", "cuda")
                                 for t in tensors)


class _DeepSpeedAdam(torch.optim.Adam):
    """torch's Adam from DeepSpeed's arguments; `decoupled` is DeepSpeed's adam(w)_mode."""

    def __init__(self, params, *, lr, bias_correction, betas, eps, weight_decay, amsgrad, decoupled):
        name = type(self).__name__
        if not bias_correction:
            raise NotImplementedError(
                f"{name}(bias_correction=False) is not implemented in meshspeed: torch's Adam "
                "always corrects the moment estimates; drop the argument (the default is True)")
        if amsgrad:
            raise ValueError(f"{name} does not support the AMSGrad variant (neither does DeepSpeed's)")
        params = _materialised(params)
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=bool(decoupled), fused=_fused_ok(params) or None)


class FusedAdam(_DeepSpeedAdam):
    """DeepSpeed's `FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode,
    weight_decay, amsgrad, set_grad_none)` over torch's Adam."""

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True):
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, amsgrad=amsgrad, decoupled=adam_w_mode)
        self.adam_w_mode = bool(adam_w_mode)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)


class DeepSpeedCPUAdam(_DeepSpeedAdam):
    """DeepSpeed's `DeepSpeedCPUAdam(model_params, lr, bias_correction, betas, eps,
    weight_decay, amsgrad, adamw_mode, fp32_optimizer_states)` over torch's Adam.

    Where the step runs is the engine's business (ZeRO-Offload puts the masters on the
    host); torch's fused kernel is the fast path on CPU. `fp32_optimizer_states` is
    accepted: meshspeed's masters, and so the moments, are fp32 already."""

    def __init__(self, model_params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, adamw_mode: bool = True,
                 fp32_optimizer_states: bool = True):
        super().__init__(model_params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, amsgrad=amsgrad, decoupled=adamw_mode)
        self.adamw_mode = bool(adamw_mode)
        self.fp32_optimizer_states = fp32_optimizer_states
