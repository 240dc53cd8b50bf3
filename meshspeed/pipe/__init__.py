"""`meshspeed.pipe`: DeepSpeed's import path ``from deepspeed.pipe import PipelineModule``.

The classes live in `meshspeed.parallel.pipeline` and `meshspeed.topology.process`; the
engine that trains them is `meshspeed.engine.pipeline.PipelineEngine` (docs/pipeline.md).
"""

from meshspeed.engine.pipeline import PipelineEngine, PipelineError
from meshspeed.parallel.pipeline.module import (
    LayerSpec,
    PipelineModule,
    TiedLayerSpec,
    split_sequential,
)
from meshspeed.topology.process import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
)

__all__ = [
    "LayerSpec",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineEngine",
    "PipelineError",
    "PipelineModule",
    "ProcessTopology",
    "TiedLayerSpec",
    "split_sequential",
]
