"""``from deepspeed.runtime.pipe.engine import PipelineEngine``: meshspeed's pipelined engine
(meshspeed/engine/pipeline.py) with DeepSpeed's getters, an instance of `DeepSpeedEngine`
as DeepSpeed's is."""

from meshspeed.compat.deepspeed.runtime.engine import DeepSpeedEngine
from meshspeed.engine import pipeline
from meshspeed.engine.pipeline import PipelineError
from meshspeed.parallel.activation_checkpoint import non_reentrant_checkpoint

__all__ = ["PipelineEngine", "PipelineError"]


class PipelineEngine(DeepSpeedEngine, pipeline.PipelineEngine):
    """What `deepspeed.initialize` returns for a PipelineModule."""

    def _reentrant_activation_checkpointing(self) -> bool:
        """Whether the module's layers are checkpointed with a reentrant checkpoint (any
        function but the non-reentrant one, with an interval above 0)."""
        module = self.module
        return (module.activation_checkpoint_interval > 0
                and module.activation_checkpoint_func is not non_reentrant_checkpoint)
