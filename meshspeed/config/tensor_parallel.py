"""The `tensor_parallel` section: DeepSpeed's AutoTP training keys plus meshspeed's own.

Owned by `meshspeed/tensor_parallel`. `autotp_size` 0 or 1 means no tensor parallelism
(DeepSpeed's default is 0). `partition_config` is DeepSpeed's custom-pattern form; it is
checked against the model when the plan is built (`plan_from_deepspeed`), where the
module names are known.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, model_validator

from meshspeed.config.base import NonNegInt, PositiveInt, StrictModel


class TPInferenceConfig(StrictModel):
    """DeepSpeed's nested `tensor_parallel.tp` block (its inference spelling of the size)."""

    tp_size: PositiveInt = 1
    tp_grain_size: PositiveInt = 1  # DeepSpeed's granularity knob; meshspeed splits evenly


class TensorParallelConfig(StrictModel):
    key_aliases: ClassVar[dict[str, str]] = {"tp_size": "autotp_size"}

    autotp_size: NonNegInt = 0  # tensor-parallel degree; 0 or 1: off
    tp_overlap_comm: bool = False  # chunk AG/RS so they run under the GEMMs
    # meshspeed: Megatron sequence parallelism (norms/dropout on a sequence shard; the
    # all-reduce becomes all-gather + reduce-scatter)
    sequence_parallel: bool = False
    overlap_chunks: int = Field(4, ge=2)  # meshspeed: chunks per collective with tp_overlap_comm
    partition_config: dict[str, Any] | None = None  # DeepSpeed's layer_specs form
    preset_model: str | None = None  # DeepSpeed preset name; meshspeed detects the family itself
    tp: TPInferenceConfig = Field(default_factory=TPInferenceConfig)
    keep_module_on_host: bool = False  # DeepSpeed loading knob; modules stay where they are

    @model_validator(mode="after")
    def _one_size(self):
        if self.tp.tp_size > 1 and self.autotp_size > 1 and self.tp.tp_size != self.autotp_size:
            raise ValueError(f"autotp_size {self.autotp_size} and tp.tp_size {self.tp.tp_size} "
                             "disagree; give one")
        return self

    @property
    def size(self) -> int:
        """The tensor-parallel degree (1 when off)."""
        return max(1, self.autotp_size, self.tp.tp_size)

    @property
    def enabled(self) -> bool:
        return self.size > 1
