"""`deepspeed.runtime.zero.offload_config`: DeepSpeed's offload sections, as views of
meshspeed's (meshspeed/config/offload.py), built by DeepSpeed's rules
(runtime/config_utils.py) with DeepSpeed's defaults: offloaded memory is pinned unless
`pin_memory` says otherwise, and the DeepSpeed-only tuning knobs of the optimizer
offload (`pipeline_read`, `pipeline_write`, `super_offload`, `cpuadam_cores_perc`) are
accepted as data; meshspeed's engine does not read them.
"""

from __future__ import annotations

from enum import Enum

from pydantic import Field

from meshspeed.compat.deepspeed.runtime.config_utils import (
    DEEPSPEED_MODEL_CONFIG,
    DeepSpeedConfigModel,
)
from meshspeed.config.offload import OffloadOptimizerConfig, OffloadParamConfig

__all__ = ["DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig", "OffloadDeviceEnum"]


class OffloadDeviceEnum(str, Enum):
    """Where offloaded state lives."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class DeepSpeedZeroOffloadParamConfig(DeepSpeedConfigModel, OffloadParamConfig):
    """`zero_optimization.offload_param`."""

    model_config = DEEPSPEED_MODEL_CONFIG

    pin_memory: bool = True  # DeepSpeed's default; meshspeed's own section defaults to False


class DeepSpeedZeroOffloadOptimizerConfig(DeepSpeedConfigModel, OffloadOptimizerConfig):
    """`zero_optimization.offload_optimizer`."""

    model_config = DEEPSPEED_MODEL_CONFIG

    pin_memory: bool = True  # DeepSpeed's default; meshspeed's own section defaults to False
    pipeline_read: bool = False  # overlap reading the next NVMe tile with the step
    pipeline_write: bool = False  # overlap writing the previous NVMe tile with the step
    super_offload: bool = False
    cpuadam_cores_perc: float = Field(0.8, ge=0.0, le=1.0)

    @property
    def pipeline(self) -> bool:
        """Whether NVMe tiles are pipelined at all (either direction)."""
        return self.pipeline_read or self.pipeline_write
