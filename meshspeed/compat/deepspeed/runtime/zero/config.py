"""`deepspeed.runtime.zero.config`: DeepSpeed's `zero_optimization` section, as a view of
meshspeed's (meshspeed/config/zero.py).

`DeepSpeedZeroConfig` is a meshspeed `ZeroConfig` built by DeepSpeed's rules
(runtime/config_utils.py). What DeepSpeed spells differently is answered in its
spelling: the stage-3 knobs meshspeed names `stage3_*` are also read without the prefix
(`config.prefetch_bucket_size`), and the DeepSpeed-only knobs meshspeed sets aside
(meshspeed/config/known_keys.py) are fields with DeepSpeed's defaults.

Note [two sets of ZeRO defaults]
Built directly (`DeepSpeedZeroConfig(**d)`), a missing key takes DeepSpeed's default:
`overlap_comm` is on at stage 3 only, `stage3_param_persistence_threshold` is 1e5,
offloaded memory is pinned. The view of a parsed config (`DeepSpeedConfig(d).zero_config`)
holds what meshspeed runs, meshspeed's defaults included: `overlap_comm` on at every stage,
persistence threshold 0 (the reasons are in meshspeed/config/zero.py). A config that
wants DeepSpeed's values sets the keys.
"""

from __future__ import annotations

import logging
import sys
from enum import IntEnum
from typing import Any, ClassVar

from pydantic import Field, model_validator

from meshspeed.compat.deepspeed.runtime.config_utils import (
    DEEPSPEED_MODEL_CONFIG,
    DeepSpeedConfigModel,
)
from meshspeed.compat.deepspeed.runtime.zero.offload_config import (
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
    OffloadDeviceEnum,
)
from meshspeed.config.base import NonNegInt
from meshspeed.config.zero import ZeroConfig

__all__ = ["ZERO_OPTIMIZATION", "DeepSpeedZeroConfig", "DeepSpeedZeroOffloadOptimizerConfig",
           "DeepSpeedZeroOffloadParamConfig", "OffloadDeviceEnum", "ZeroStageEnum", "get_zero_config"]

ZERO_OPTIMIZATION = "zero_optimization"


class ZeroStageEnum(IntEnum):
    """ZeRO stages by what they shard."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3  # an alias of weights


class DeepSpeedZeroConfig(DeepSpeedConfigModel, ZeroConfig):
    """`zero_optimization`, with DeepSpeed's names and defaults (Note [two sets of ZeRO defaults])."""

    model_config = DEEPSPEED_MODEL_CONFIG

    # meshspeed's spellings, plus DeepSpeed's "stage3_" prefix for DeepSpeed-only knobs
    key_aliases: ClassVar[dict[str, str]] = {
        **ZeroConfig.key_aliases,
        "stage3_model_persistence_threshold": "model_persistence_threshold",
        "stage3_module_granularity_threshold": "module_granularity_threshold",
        "stage3_use_all_reduce_for_fetch_params": "use_all_reduce_for_fetch_params",
        "stage3_allgather_sequential": "allgather_sequential",
    }

    overlap_comm: bool | None = None  # None: on at stage 3 only (DeepSpeed's default)
    stage3_param_persistence_threshold: NonNegInt = 100_000
    offload_param: DeepSpeedZeroOffloadParamConfig | None = None
    offload_optimizer: DeepSpeedZeroOffloadOptimizerConfig | None = None

    # DeepSpeed-only knobs, with DeepSpeed's defaults; meshspeed's engine does not read them
    use_multi_rank_bucket_allreduce: bool = True
    compute_grad_norm: bool = True
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    zenflow: dict[str, Any] | None = None
    cpu_offload_use_pin_memory: bool | None = None
    model_persistence_threshold: NonNegInt = sys.maxsize
    module_granularity_threshold: int = 0
    use_all_reduce_for_fetch_params: bool = False
    allgather_sequential: bool = False
    ignore_unused_parameters: bool = True
    legacy_stage1: bool = False
    parameter_alignment: bool = False
    zero_quantized_nontrainable_weights: bool = False
    memory_efficient_linear: bool = True
    pipeline_loading_checkpoint: bool = False
    override_module_apply: bool = True
    log_trace_cache_warnings: bool = False
    enable_sanity_checks: bool = False
    save_muon_momentum_buffer_in_memory: bool = False
    leaf_module: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _overlap_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("overlap_comm") is None:
            stage = data.get("stage", 0)
            data = {**data, "overlap_comm": stage == ZeroStageEnum.weights}
        return data

    @model_validator(mode="after")
    def _elastic_checkpoint_is_not_for_stage3(self):
        if self.elastic_checkpoint and self.stage == ZeroStageEnum.weights:
            logging.getLogger("meshspeed").warning(
                "ZeRO-3 elastic checkpointing is deprecated and has no effect: zero_optimization."
                "elastic_checkpoint applies to ZeRO 1-2 in DeepSpeed, and meshspeed's checkpoints load at any "
                "data-parallel size at every stage")
        return self

    @model_validator(mode="after")
    def _grad_norm_needs_stage_1_or_2(self):
        if not self.compute_grad_norm and self.stage not in (1, 2):
            raise ValueError(f"compute_grad_norm=false is supported with ZeRO stage 1 or 2 only (got stage "
                             f"{self.stage}); set compute_grad_norm to true or use stage 1 or 2")
        return self

    @model_validator(mode="after")
    def _partial_offload_needs_stage3(self):
        ratio = self.offload_optimizer.ratio if self.offload_optimizer is not None else 1.0
        if ratio < 1.0 and self.stage != 3:
            raise ValueError(f"offload_optimizer.ratio {ratio} offloads part of the optimizer, which only "
                             f"ZeRO stage 3 does (got stage {self.stage}); set ratio to 1.0 or use stage 3")
        return self

    # DeepSpeed's names for the stage-3 knobs meshspeed spells with their "stage3_" prefix
    @property
    def prefetch_bucket_size(self) -> int:
        return self.stage3_prefetch_bucket_size

    @property
    def param_persistence_threshold(self) -> int:
        return self.stage3_param_persistence_threshold

    @property
    def max_live_parameters(self) -> int:
        return self.stage3_max_live_parameters

    @property
    def max_reuse_distance(self) -> int:
        return self.stage3_max_reuse_distance

    @property
    def gather_16bit_weights_on_model_save(self) -> bool:
        return self.stage3_gather_16bit_weights_on_model_save


def get_zero_config(param_dict: dict[str, Any]) -> DeepSpeedZeroConfig:
    """The `zero_optimization` section of a DeepSpeed config dict, by DeepSpeed's rules
    (`"zero_optimization": true`, DeepSpeed's oldest form, is stage 1)."""
    section = param_dict.get(ZERO_OPTIMIZATION, {})
    if isinstance(section, bool):
        section = {"stage": int(section)}
    return DeepSpeedZeroConfig(**section)
