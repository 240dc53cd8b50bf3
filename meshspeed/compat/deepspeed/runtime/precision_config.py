"""`deepspeed.runtime.precision_config`: DeepSpeed's fp16 and bf16 sections, as views of
meshspeed's (meshspeed/config/precision.py).

`DeepSpeedFP16Config` is a meshspeed `FP16Config` built by DeepSpeed's rules
(runtime/config_utils.py); it adds the DeepSpeed-only key `fp16_master_weights_and_grads`,
which meshspeed parses and refuses when true (meshspeed/config/unbuilt.py). Likewise
`DeepSpeedBF16Config` over `BF16Config`, with DeepSpeed's four bf16 knobs.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import field_validator

from meshspeed.compat.deepspeed.runtime.config_utils import (
    DEEPSPEED_MODEL_CONFIG,
    DeepSpeedConfigModel,
)
from meshspeed.config.errors import show
from meshspeed.config.precision import BF16Config, FP16Config

__all__ = ["BFLOAT16", "BFLOAT16_OLD", "FP16", "DeepSpeedBF16Config", "DeepSpeedFP16Config",
           "get_bfloat16_config", "get_float16_config"]

BFLOAT16 = "bf16"
BFLOAT16_OLD = "bfloat16"  # DeepSpeed's older name for the section
FP16 = "fp16"


class DeepSpeedFP16Config(DeepSpeedConfigModel, FP16Config):
    """The `fp16` section: meshspeed's fields and defaults, DeepSpeed's construction rules."""

    model_config = DEEPSPEED_MODEL_CONFIG

    fp16_master_weights_and_grads: bool = False  # DeepSpeed's; meshspeed keeps fp32 masters

    @field_validator("loss_scale", mode="before")
    @classmethod
    def _number(cls, value: Any) -> Any:
        # lax pydantic would read true as 1.0 and a list as an opaque type error
        if isinstance(value, bool):
            # pydantic reports ValueError per field; a TypeError would escape unformatted
            raise ValueError(f"fp16.loss_scale must be a number, not {show(value)} (0: dynamic loss scaling)")  # noqa: TRY004
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"fp16.loss_scale must be a number (got {show(value)}); 0 means dynamic "
                             "loss scaling, a positive number a fixed scale") from None
        if not math.isfinite(number):
            raise ValueError(f"fp16.loss_scale must be a finite number (got {value})")
        return number

    def initial_dynamic_scale(self) -> float:
        """The loss scale dynamic scaling starts at."""
        return 2.0 ** self.initial_scale_power


class DeepSpeedBF16Config(DeepSpeedConfigModel, BF16Config):
    """The `bf16` section: `enabled` is meshspeed's; the rest are DeepSpeed's knobs, which
    meshspeed parses and refuses or ignores as meshspeed/config/unbuilt.py says."""

    model_config = DEEPSPEED_MODEL_CONFIG

    immediate_grad_update: bool = False
    check_grad_overflow: bool = True
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False


def get_bfloat16_config(param_dict: dict[str, Any]) -> DeepSpeedBF16Config:
    """The bf16 section of a DeepSpeed config dict (`bf16`, or its old name `bfloat16`)."""
    section = param_dict.get(BFLOAT16)
    if section is None:
        section = param_dict.get(BFLOAT16_OLD, {})
    return DeepSpeedBF16Config(**section)


def get_float16_config(param_dict: dict[str, Any]) -> DeepSpeedFP16Config:
    """The fp16 section of a DeepSpeed config dict."""
    return DeepSpeedFP16Config(**param_dict.get(FP16, {}))
