"""`meshspeed.runtime.pipe`: DeepSpeed's longer import path for the pipeline classes
(``deepspeed.runtime.pipe``, ``.module``, ``.topology``); the same objects as `meshspeed.pipe`."""

from meshspeed.parallel.pipeline.module import (
    LayerSpec,
    PipelineModule,
    TiedLayerSpec,
    split_sequential,
)
from meshspeed.topology.process import ProcessTopology

__all__ = ["LayerSpec", "PipelineModule", "ProcessTopology", "TiedLayerSpec", "split_sequential"]
