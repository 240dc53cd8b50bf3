"""The `pipeline` section: DeepSpeed's pipeline block plus meshspeed's schedule choice
and activation compression.

Owned by `meshspeed/parallel/pipeline` and `meshspeed/engine/pipeline.py`. The number
of stages is the model's (`PipelineModule(num_stages=...)`); `stages` here, when a
number, must agree with it. `partition` and `seed_layers` are the config spellings of
PipelineModule's own arguments and, as in DeepSpeed, the module's arguments are what
count. As in DeepSpeed's engine, `activation_checkpoint_interval` above 0 replaces the
module's, and `use_reentrant: false` checkpoints the pipeline's layers with the
non-reentrant checkpoint (meshspeed/parallel/activation_checkpoint.py) instead of the module's
function (applied at initialize, meshspeed/parallel/pipeline/axis.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from meshspeed.config.base import NonNegInt, PositiveInt, StrictModel

SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1")


class PipelineConfig(StrictModel):
    stages: PositiveInt | Literal["auto"] = "auto"  # "auto": the model's num_stages
    partition: str = "best"  # DeepSpeed's spelling; the module's partition_method decides
    seed_layers: bool = False
    activation_checkpoint_interval: NonNegInt = 0
    use_reentrant: bool = True  # False: the pipeline's layers use the non-reentrant checkpoint
    # DeepSpeed sends 1/tp of each activation and all-gathers it on arrival; here every tp
    # rank sends its whole (identical) activation to its peer: same numbers, more bytes
    pipe_partitioned: bool = True
    grad_partitioned: bool = True
    # meshspeed: the micro-batch schedule (meshspeed/parallel/pipeline/schedule.py)
    schedule: Literal["1f1b", "gpipe", "interleaved", "zb-h1"] = "1f1b"
    virtual_stages: PositiveInt = Field(1)  # model chunks per stage, for "interleaved"
    # meshspeed: how floating activations and their gradients travel between stages:
    # "bf16" (fp32 sent as bf16, 1/2 the bytes) or "int8" (per-token max-abs scales,
    # 1/4 the bytes + 4 per token); Note [compressed activations between stages] in
    # meshspeed/parallel/pipeline/compress.py
    activation_compression: Literal["none", "bf16", "int8"] = "none"
