"""`deepspeed.runtime.pipe`: DeepSpeed's longer import path for the pipeline classes
(``.module``, ``.topology``, ``.engine``, ``.schedule``); the same objects as `deepspeed.pipe`."""

from meshspeed.compat.deepspeed.runtime.pipe.module import (
    LayerSpec,
    PipelineModule,
    TiedLayerSpec,
    split_sequential,
)
from meshspeed.compat.deepspeed.runtime.pipe.topology import ProcessTopology

__all__ = ["LayerSpec", "PipelineModule", "ProcessTopology", "TiedLayerSpec", "split_sequential"]
