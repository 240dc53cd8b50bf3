"""Update rules for the offloaded optimizer: torch's own CPU kernels over tensor lists.

No JIT-compiled extension (pain point 8: DeepSpeed's CPU Adam is a C++ op built at first
use, and that build is a recurring failure). torch ships a fused, vectorised Adam/AdamW
for CPU (`fused=True`, one pass over param, grad, m and v per element, multi-threaded);
that is the default here. `fused=False` selects torch's reference kernel instead, which
is bit-for-bit what `torch.optim.AdamW()` computes, so an offloaded run can be compared
exactly with a run that is not offloaded; the fused kernel agrees to within a few ulp
(it orders the arithmetic differently). benchmarks/adam.py measures both against the
memory-bandwidth limit.

A rule never reads `param.grad`: gradients are passed in, so a step can run in a
background thread after the engine has moved on (Note [delayed parameter update] in
placement.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.adam import adam as _adam
from torch.optim.sgd import sgd as _sgd


@dataclass(frozen=True)
class AdamRule:
    """Adam (decoupled=False: L2 penalty added to the gradient) or AdamW (decoupled)."""

    decoupled: bool
    fused: bool = True
    state_keys: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
    zero_init: bool = True  # state starts as zeros (so it can be created inside swap buffers)
    counts_steps: bool = True

    def step(self, params, grads, state: dict[str, list], steps: list[torch.Tensor],
             options: dict[str, Any]) -> None:
        beta1, beta2 = options["betas"]
        _adam(params, grads, state["exp_avg"], state["exp_avg_sq"], [], steps,
              foreach=False, fused=self.fused, decoupled_weight_decay=self.decoupled,
              amsgrad=False, beta1=beta1, beta2=beta2, lr=_float(options["lr"]),
              weight_decay=options["weight_decay"], eps=options["eps"],
              maximize=options.get("maximize", False))


@dataclass(frozen=True)
class SgdRule:
    """SGD with optional momentum; the momentum buffer is created by the first step (as in
    torch, where it starts as a copy of the gradient), so it is not zero-initialised."""

    momentum: bool
    fused: bool = True
    zero_init: bool = False
    counts_steps: bool = False

    @property
    def state_keys(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.momentum else ()

    def step(self, params, grads, state: dict[str, list], steps, options: dict[str, Any]) -> None:
        buffers = state.get("momentum_buffer", [None] * len(params))
        _sgd(params, grads, buffers, foreach=False, fused=self.fused and self.momentum,
             weight_decay=options["weight_decay"], momentum=options["momentum"],
             lr=_float(options["lr"]), dampening=options["dampening"],
             nesterov=options["nesterov"], maximize=options.get("maximize", False))
        if self.momentum:
            state["momentum_buffer"] = buffers  # filled in by the first step


def _float(value) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)
