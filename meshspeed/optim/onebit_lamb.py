"""1-bit LAMB (Li et al., arXiv:2104.06069): LAMB whose momentum is averaged in 1 bit.

Note [1-bit LAMB's two phases]
Warm-up, steps 1..freeze_step: LAMB over the engine's fp32 gradient all-reduce. The update
u = m / (sqrt(v) + eps) + weight_decay * p is scaled per tensor by the trust ratio
c = clamp(|p| / |u|, min_coeff, max_coeff); an exponential average of c (coeff_beta) is
kept as the tensor's frozen coefficient. At step freeze_step, v is copied to v_fresh.
Compressed, every later step: v is frozen, gradients stay local. On the first such step
each tensor gets a scaling coefficient, the mean over tensors of rms(m) divided by its own
rms(m), so that all momenta have similar magnitudes; each step every rank folds its
gradient into m, multiplies by the coefficient, and all momenta are averaged as one flat
tensor with one scale (1 bit per element), then divided back. The gradient the averaged
momentum implies, (m - beta1 m_last) / (1 - beta1), updates v_fresh; the trust ratio
becomes the frozen coefficient times a factor max(denominator(v) / denominator(v_fresh)),
mixed with 1 by the share of weight decay in |u|, clamped to [factor_min, factor_max] and
to within factor_threshold of the last step's factor.
The update has no bias correction, as DeepSpeed's (which also spends its first `step()` on
initialisation; meshspeed's first step is LAMB's: Note [1-bit Adam's two phases]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from meshspeed.optim.onebit import CompressedOptimizer, whole_number

__all__ = ["OneBitLamb"]


class OneBitLamb(CompressedOptimizer):
    """DeepSpeed's `OnebitLamb` params over meshspeed's compressed all-reduce on `group`."""

    def __init__(self, params, lr: float = 1e-3, freeze_step: int = 100000,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 bias_correction: bool = True, max_coeff: float = 10.0, min_coeff: float = 0.01,
                 coeff_beta: float = 0.9, factor_max: float = 4.0, factor_min: float = 0.5,
                 factor_threshold: float = 0.1, cuda_aware: bool = False, comm_backend_name: str = "nccl",
                 group: Any = None):
        self.freeze_step = whole_number("freeze_step", freeze_step)
        self.coeff_beta, self.factor_threshold = coeff_beta, factor_threshold
        self.factor_max, self.factor_min = factor_max, factor_min
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "max_coeff": max_coeff, "min_coeff": min_coeff}
        super().__init__(params, defaults, cuda_aware=cuda_aware, comm_backend_name=comm_backend_name,
                         group=group)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = self._evaluate(closure)
        compressed = self.gradients_local()
        live = self._live_params(lambda p: {
            "lamb_coeff_freeze": 0.0, "last_factor": 1.0, "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p), "exp_avg_sq_fresh": torch.zeros_like(p)})
        if compressed:
            self._compressed_step(live)
        else:
            for p, state, group in live:
                self._warm_up_step(p, state, group)
        return loss

    def _warm_up_step(self, p: torch.Tensor, state: dict, group: dict) -> None:
        beta1, beta2 = group["betas"]
        state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        if state["step"] == self.freeze_step:
            state["exp_avg_sq_fresh"].copy_(state["exp_avg_sq"])
        update = state["exp_avg"] / (state["exp_avg_sq"].sqrt() + group["eps"])
        if group["weight_decay"] > 0:
            update.add_(p, alpha=group["weight_decay"])
        weight_norm, update_norm = float(p.norm()), float(update.norm())
        coeff = 1.0
        if weight_norm != 0 and update_norm != 0:
            coeff = min(max(weight_norm / update_norm, group["min_coeff"]), group["max_coeff"])
        if coeff != 1.0:  # DeepSpeed's rule: a coefficient of exactly 1 is not averaged in
            state["lamb_coeff_freeze"] = self.coeff_beta * state["lamb_coeff_freeze"] + (1 - self.coeff_beta) * coeff
        p.add_(update, alpha=-group["lr"] * coeff)

    def _compressed_step(self, live: list) -> None:
        if live and "scaling_coeff" not in live[0][1]:  # the first compressed step
            rms = [float(s["exp_avg"].norm()) / s["exp_avg"].numel() ** 0.5 for _, s, _ in live]
            united = sum(rms) / len(rms)
            for (_, state, _), r in zip(live, rms):
                state["scaling_coeff"] = united / r if r > 0 else 1.0
        last = [state["exp_avg"].clone() for _, state, _ in live]
        for p, state, group in live:
            beta1 = group["betas"][0]
            state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1).mul_(state["scaling_coeff"])
        if self.world > 1 and live:
            self._average_compressed([state["exp_avg"] for _, state, _ in live], one_scale=True)
        for (p, state, group), m_last in zip(live, last):
            beta1, beta2 = group["betas"]
            m = state["exp_avg"].div_(state["scaling_coeff"])
            grad = (m - m_last * beta1) / (1 - beta1)  # the gradient the averaged momentum implies
            state["exp_avg_sq_fresh"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = state["exp_avg_sq"].sqrt() + group["eps"]
            prelim = m / denom
            update = prelim + group["weight_decay"] * p if group["weight_decay"] > 0 else prelim
            factor = float((denom / (state["exp_avg_sq_fresh"].sqrt() + group["eps"])).max())
            if group["weight_decay"] > 0:
                ratio = min(1.0, float(prelim.norm() / update.norm()))
                factor = factor * ratio + (1.0 - ratio)
            factor = min(max(factor, self.factor_min), self.factor_max)
            last_factor = state["last_factor"]
            factor = min(max(factor, last_factor * (1 - self.factor_threshold)),
                         last_factor * (1 + self.factor_threshold))
            state["last_factor"] = factor
            p.add_(update, alpha=-group["lr"] * state["lamb_coeff_freeze"] * factor)
