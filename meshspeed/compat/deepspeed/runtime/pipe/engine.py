"""``from deepspeed.runtime.pipe.engine import PipelineEngine``."""

from meshspeed.engine.pipeline import PipelineEngine, PipelineError

__all__ = ["PipelineEngine", "PipelineError"]
