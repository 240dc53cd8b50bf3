"""Pipeline parallelism. For now the layer-list model interface only, with one stage:
see Note [one pipeline stage only] in module.py."""

from meshspeed.parallel.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
