"""`meshspeed.pipe`: DeepSpeed's import path ``from deepspeed.pipe import PipelineModule``.

DeepSpeed's `PipelineModule` (with `topology=`) is meshspeed/compat/deepspeed/runtime/pipe/module.py
over meshspeed's own (meshspeed/parallel/pipeline/module.py); the engine that trains it is
`meshspeed.engine.pipeline.PipelineEngine` (docs/pipeline.md).
"""

from meshspeed.compat.deepspeed.runtime.pipe.engine import PipelineEngine, PipelineError
from meshspeed.compat.deepspeed.runtime.pipe.module import (
    LayerSpec,
    PipelineModule,
    TiedLayerSpec,
    split_sequential,
)
from meshspeed.compat.deepspeed.runtime.pipe.topology import (
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
