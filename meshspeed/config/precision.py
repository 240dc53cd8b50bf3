"""Mixed-precision sections: `fp16` (with dynamic loss scaling) and `bf16`.

Owned by `meshspeed/optim` (master weights, loss scaling).
"""

from __future__ import annotations

from meshspeed.config.base import NonNegFloat, NonNegInt, PositiveFloat, PositiveInt, StrictModel


class FP16Config(StrictModel):
    """Train in float16 with fp32 master weights and a loss scaler."""

    enabled: bool = False
    auto_cast: bool = False  # cast floating-point module inputs to fp16
    loss_scale: NonNegFloat = 0.0  # 0 means dynamic loss scaling; > 0 is a fixed scale
    initial_scale_power: NonNegInt = 16  # dynamic scaling starts at 2**initial_scale_power
    loss_scale_window: PositiveInt = 1000  # overflow-free steps before the scale doubles
    hysteresis: PositiveInt = 2  # overflows tolerated before the scale halves
    consecutive_hysteresis: bool = False  # refill hysteresis after each clean step
    min_loss_scale: PositiveFloat = 1.0  # dynamic scale never drops below this


class BF16Config(StrictModel):
    """Train in bfloat16 with fp32 master weights; no loss scaling needed."""

    enabled: bool = False
