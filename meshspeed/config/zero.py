"""The `zero_optimization` section: which training state ZeRO shards, and how it moves.

Owned by `meshspeed/parallel/zero`. Stage 0 shards nothing, 1 shards optimizer state,
2 adds gradients, 3 adds parameters (Rajbhandari et al., "ZeRO", SC 2020).
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, model_validator

from meshspeed.config.base import NonNegInt, StrictModel, whole_number
from meshspeed.config.offload import OffloadOptimizerConfig, OffloadParamConfig

logger = logging.getLogger("meshspeed")

Stage = Annotated[Literal[0, 1, 2, 3], BeforeValidator(whole_number)]


class ZeroConfig(StrictModel):
    """ZeRO sharding stage, bucket sizes and offload targets. Sizes count elements."""

    # DeepSpeed accepts the stage-3 knobs with and without their "stage3_" prefix.
    key_aliases: ClassVar[dict[str, str]] = {
        "prefetch_bucket_size": "stage3_prefetch_bucket_size",
        "param_persistence_threshold": "stage3_param_persistence_threshold",
        "max_live_parameters": "stage3_max_live_parameters",
        "max_reuse_distance": "stage3_max_reuse_distance",
        "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    }
    legacy_keys: ClassVar[frozenset[str]] = frozenset({"cpu_offload", "cpu_offload_param"})

    stage: Stage = 0
    contiguous_gradients: bool = True  # copy gradients into one flat buffer as produced
    overlap_comm: bool = True  # reduce gradients while backward still runs
    reduce_scatter: bool = True  # reduce-scatter (vs all-reduce) gradients in stages 1-2
    reduce_bucket_size: NonNegInt = 500_000_000
    allgather_partitions: bool = True  # all-gather (vs broadcasts) updated shards
    allgather_bucket_size: NonNegInt = 500_000_000
    round_robin_gradients: bool = False  # spread gradient copies to CPU across ranks
    sub_group_size: NonNegInt = 1_000_000_000  # optimizer-step tile for offload/NVMe
    # stage 3 only
    stage3_prefetch_bucket_size: NonNegInt = 50_000_000  # elements fetched ahead of use
    # params of at most this many elements stay whole under stage 3. DeepSpeed defaults to
    # 1e5 because it gathers parameter by parameter; meshspeed gathers a whole block in one
    # collective, where small params ride along for free, so keeping them whole would only
    # cost memory (at d_model 256 every attention matrix is below 1e5). Default 0.
    stage3_param_persistence_threshold: NonNegInt = 0
    stage3_max_live_parameters: NonNegInt = 1_000_000_000  # gathered elements kept resident
    stage3_max_reuse_distance: NonNegInt = 1_000_000_000  # keep if reused within this many
    # read by engine.zero_gather_16bit_weights_on_model_save(): Hugging Face and accelerate
    # consolidate the weights on save_model when true and write a full checkpoint when false
    stage3_gather_16bit_weights_on_model_save: bool = False
    # ZeRO++ qwZ (arXiv:2306.10209): stage-3 parameter all-gathers carry block-quantized
    # INT8 weights and fp32 scales instead of the 16/32-bit shards (parallel/zero/qwz.py)
    zero_quantized_weights: bool = False
    # ZeRO++ qgZ: stages 2-3 reduce each unit's gradients by one all-to-all of INT4 shards
    # and fp32 scales instead of a reduce-scatter (parallel/zero/qgz.py)
    zero_quantized_gradients: bool = False
    # ZeRO++ hpZ: stage 3 also keeps each unit partitioned over groups of this many
    # consecutive ranks (a node) and gathers from there after the forward, so backward's
    # gathers stay inside the node; 1 keeps no secondary copy (parallel/zero/hpz.py)
    zero_hpz_partition_size: Annotated[int, BeforeValidator(whole_number)] = 1
    offload_optimizer: OffloadOptimizerConfig | None = None
    offload_param: OffloadParamConfig | None = None
    # false: a step whose accumulation window left a trainable parameter without a
    # gradient raises, naming it (meshspeed/engine/unused.py), at every stage
    ignore_unused_parameters: bool = True

    @model_validator(mode="before")
    @classmethod
    def _translate_legacy(cls, data: Any) -> Any:
        # Old configs said `"cpu_offload": true` / `"cpu_offload_param": true`; both mean
        # offloading to CPU and give way to an explicit offload_optimizer / offload_param.
        if not isinstance(data, dict) or not cls.legacy_keys & data.keys():
            return data
        data = dict(data)
        for old, new in (
            ("cpu_offload", "offload_optimizer"),
            ("cpu_offload_param", "offload_param"),
        ):
            if old not in data:
                continue
            flag = data.pop(old)
            if not isinstance(flag, bool):
                raise ValueError(f"{old} must be true or false (got {flag!r})")  # noqa: TRY004
            logger.warning("zero_optimization.%s is deprecated; use %s instead", old, new)
            if flag and data.get(new) is None:
                data[new] = {"device": "cpu"}
        return data

    @model_validator(mode="after")
    def _quantized_weights_need_stage3(self):
        if self.zero_quantized_weights and self.stage != 3:
            raise ValueError(
                f"zero_quantized_weights quantizes the parameter all-gathers of stage 3, and stage "
                f"{self.stage} gathers no parameters around their use; set stage 3 or drop the key")
        return self

    @model_validator(mode="after")
    def _hpz_needs_stage3(self):
        if self.zero_hpz_partition_size < 1:
            raise ValueError(f"zero_hpz_partition_size must be a positive number of ranks (1: off), "
                             f"got {self.zero_hpz_partition_size}")
        if self.zero_hpz_partition_size > 1 and self.stage != 3:
            raise ValueError(
                f"zero_hpz_partition_size partitions a second copy of stage 3's parameters, and stage "
                f"{self.stage} keeps its parameters whole; set stage 3 or drop the key")
        return self

    @model_validator(mode="after")
    def _quantized_gradients_need_stage_2_or_3(self):
        if self.zero_quantized_gradients and self.stage not in (2, 3):
            raise ValueError(
                f"zero_quantized_gradients quantizes the per-unit gradient reduce-scatter of stages 2 "
                f"and 3, and stage {self.stage} has none; set stage 2 or 3 or drop the key")
        return self
