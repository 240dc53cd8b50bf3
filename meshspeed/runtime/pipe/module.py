"""``from deepspeed.runtime.pipe.module import PipelineModule, LayerSpec, TiedLayerSpec``."""

from meshspeed.parallel.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
