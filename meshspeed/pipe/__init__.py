"""`meshspeed.pipe`: DeepSpeed's import path ``from deepspeed.pipe import PipelineModule``.

The classes live in `meshspeed.parallel.pipeline` (one stage only for now, see
Note [one pipeline stage only]) and `meshspeed.topology.process`.
"""

from meshspeed.parallel.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec
from meshspeed.topology.process import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
)

__all__ = [
    "LayerSpec",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineModule",
    "ProcessTopology",
    "TiedLayerSpec",
]
