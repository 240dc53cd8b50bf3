"""``from deepspeed.runtime.pipe.engine import PipelineEngine``: meshspeed's pipelined engine
(meshspeed/engine/pipeline.py) with DeepSpeed's getters, an instance of `DeepSpeedEngine`
as DeepSpeed's is."""

from meshspeed.compat.deepspeed.runtime.engine import DeepSpeedEngine
from meshspeed.engine import pipeline
from meshspeed.engine.pipeline import PipelineError

__all__ = ["PipelineEngine", "PipelineError"]


class PipelineEngine(DeepSpeedEngine, pipeline.PipelineEngine):
    """What `deepspeed.initialize` returns for a PipelineModule."""
