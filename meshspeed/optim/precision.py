"""Mixed precision around the optimizer step: unscale, detect overflow, agree across ranks.

Master weights and the dtype the model computes in are the strategy's business; this file
only owns the loss scale (fp16) and the decision to skip a step.
"""

from __future__ import annotations

import logging

import torch

from meshspeed import comm
from meshspeed.optim.loss_scaler import DynamicLossScaler, StaticLossScaler, has_inf_or_nan

log = logging.getLogger("meshspeed")


class NoScaler:
    scale = 1.0

    def update(self, overflow: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def build_scaler(fp16_cfg):
    if not fp16_cfg.enabled:
        return NoScaler()
    if fp16_cfg.loss_scale and fp16_cfg.loss_scale > 0:
        return StaticLossScaler(fp16_cfg.loss_scale)
    return DynamicLossScaler(
        initial_scale_power=fp16_cfg.initial_scale_power,
        loss_scale_window=fp16_cfg.loss_scale_window,
        hysteresis=fp16_cfg.hysteresis,
        consecutive_hysteresis=fp16_cfg.consecutive_hysteresis,
        min_loss_scale=fp16_cfg.min_loss_scale,
    )


def unscale_and_check(grads: list[torch.Tensor], scale: float, groups=(),
                      device: torch.device | None = None, local: bool = False) -> bool:
    """Divide gradients by the loss scale; return True when any rank saw inf/NaN.

    With replicated gradients (`groups` empty) every rank sees the same values, so no
    collective is needed; with gradients sharded over `groups` (the strategy's
    `StepGradients.groups`), one scalar all-reduce (max) per group makes every rank skip
    together. `local`: inf/NaN already seen in gradients checked elsewhere (files)."""
    if scale != 1.0 and grads:
        torch._foreach_mul_(grads, 1.0 / scale)
    overflow = torch.tensor(float(local or has_inf_or_nan(grads)), device=device)  # backend's device
    for group in groups:
        comm.all_reduce(overflow, group=group, op="max")
    return bool(overflow.item())
