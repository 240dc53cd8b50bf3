"""fp16 loss scaling (Micikevicius et al. 2018, https://arxiv.org/abs/1710.03740).

The loss is multiplied by `scale` before backward so small fp16 gradients do not flush to
zero; gradients are divided by it before the optimizer step. A step whose gradients hold
inf/NaN is skipped and the scaler is told `update(overflow=True)`.

Dynamic scaling follows DeepSpeed's fp16 config keys and rules exactly, so loss-scale
trajectories match a DeepSpeed run step for step:

* `initial_scale_power`: the scale starts at 2**initial_scale_power.
* `hysteresis`: overflows tolerated before the scale drops. Each overflow while more than
  one unit of budget is left spends one unit and keeps the scale; once one unit is left,
  every overflow divides the scale by `scale_factor` (never below `min_loss_scale`).
* `loss_scale_window`: the scale is multiplied by `scale_factor` on the good step that
  follows `loss_scale_window` consecutive good steps (counting since the last overflow),
  and again every `loss_scale_window` good steps after that. Growing the scale also
  refills the hysteresis budget.
* `consecutive_hysteresis=True`: the budget is refilled by every good step instead, so
  only *consecutive* overflows can lower the scale.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import torch

logger = logging.getLogger(__name__)


def has_inf_or_nan(tensors: Iterable[torch.Tensor | None]) -> bool:
    """True if any element of any tensor is inf or NaN. `None` entries are skipped.

    One fused max-abs reduction per device and one host sync per device, instead of a sync
    per tensor. The max-abs norm (not a sum) never overflows on large finite values.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if t is not None and t.numel() > 0:
            by_device.setdefault(t.device, []).append(t)
    for group in by_device.values():
        norms = torch._foreach_norm(group, math.inf)  # one 0-d tensor per input
        if not bool(torch.stack([n.float() for n in norms]).isfinite().all()):
            return True
    return False


class StaticLossScaler:
    """A fixed loss scale (DeepSpeed `"fp16": {"loss_scale": <scale>}` with scale > 0)."""

    dynamic = False

    def __init__(self, scale: float = 1.0):
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"loss scale must be a positive finite number, got {scale}")
        self._scale = float(scale)

    @property
    def scale(self) -> float:
        return self._scale

    def update(self, overflow: bool) -> None:
        if overflow:
            logger.warning(
                "fp16 gradients overflowed with the static loss scale %s; the step was "
                "skipped. If this repeats, lower fp16.loss_scale or set it to 0 for dynamic "
                "loss scaling.",
                self._scale,
            )

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self._scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scale = float(state["scale"])


class DynamicLossScaler:
    """Dynamic loss scale with DeepSpeed's semantics (see the module docstring)."""

    dynamic = True

    def __init__(
        self,
        initial_scale_power: int = 16,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        min_loss_scale: float = 1.0,
        scale_factor: float = 2.0,
    ):
        if loss_scale_window < 1:
            raise ValueError(f"loss_scale_window must be >= 1, got {loss_scale_window}")
        if hysteresis < 1:
            raise ValueError(f"hysteresis must be >= 1, got {hysteresis}")
        if not min_loss_scale > 0:
            raise ValueError(f"min_loss_scale must be > 0, got {min_loss_scale}")
        if not scale_factor > 1:
            raise ValueError(f"scale_factor must be > 1, got {scale_factor}")
        self.loss_scale_window = loss_scale_window
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_loss_scale = float(min_loss_scale)
        self.scale_factor = float(scale_factor)
        self._scale = max(2.0**initial_scale_power, self.min_loss_scale)
        self._hysteresis_left = hysteresis  # overflows still tolerated at this scale
        self._good_steps = 0  # consecutive non-overflow steps since the last overflow
        self._overflows_at_min = 0  # consecutive overflows with the scale at its floor

    @property
    def scale(self) -> float:
        return self._scale

    def update(self, overflow: bool) -> None:
        """Record the outcome of one step and adjust the scale for the next one."""
        if overflow:
            self._on_overflow()
        else:
            self._on_good_step()

    def _on_overflow(self) -> None:
        self._good_steps = 0
        if self._hysteresis_left > 1:
            self._hysteresis_left -= 1
            logger.info(
                "fp16 overflow, step skipped; keeping loss scale %s (hysteresis left: %d)",
                self._scale,
                self._hysteresis_left,
            )
            return
        if self._scale <= self.min_loss_scale:
            self._overflows_at_min += 1
            self._warn_at_min()
            return
        new_scale = max(self._scale / self.scale_factor, self.min_loss_scale)
        logger.info("fp16 overflow, step skipped; loss scale %s -> %s", self._scale, new_scale)
        self._scale = new_scale

    def _on_good_step(self) -> None:
        self._overflows_at_min = 0
        self._good_steps += 1
        if self.consecutive_hysteresis:
            self._hysteresis_left = self.hysteresis
        # Grow on good steps number window+1, 2*window+1, ...: DeepSpeed counts the steps
        # *before* the current one since the last overflow. Kept for trajectory parity.
        stable = self._good_steps - 1
        if stable > 0 and stable % self.loss_scale_window == 0:
            self._scale *= self.scale_factor
            self._hysteresis_left = self.hysteresis

    def _warn_at_min(self) -> None:
        # Every skipped step at the floor is a lost step, but a diverged run overflows on
        # every step; warn on the 1st, 2nd, 4th, 8th, ... in a row to stay readable.
        n = self._overflows_at_min
        if n & (n - 1):
            return
        logger.warning(
            "fp16 gradients overflowed with the loss scale already at min_loss_scale=%s "
            "(%d consecutive overflow(s) at the minimum); the optimizer step was skipped. "
            "Lowering the scale further cannot help if the gradients are inf/NaN even "
            "unscaled. Check that the loss itself is finite (data, forward pass); if "
            "training diverged, lower the learning rate, lengthen warmup or enable "
            "gradient_clipping; if activations exceed fp16's range (65504), switch to bf16 "
            '("bf16": {"enabled": true}). Only if gradients are merely large, lower '
            "fp16.min_loss_scale.",
            self.min_loss_scale,
            n,
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self._scale,
            "hysteresis_left": self._hysteresis_left,
            "good_steps": self._good_steps,
            "overflows_at_min": self._overflows_at_min,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scale = float(state["scale"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self._good_steps = int(state["good_steps"])
        self._overflows_at_min = int(state.get("overflows_at_min", 0))
