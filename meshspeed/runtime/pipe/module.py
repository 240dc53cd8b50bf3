"""``from deepspeed.runtime.pipe.module import PipelineModule, LayerSpec, TiedLayerSpec``."""

from meshspeed.parallel.pipeline.module import (
    LayerSpec,
    PipelineModule,
    TiedLayerSpec,
    split_sequential,
)

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec", "split_sequential"]
