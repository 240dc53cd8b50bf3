"""`deepspeed.runtime.zero.stage_1_and_2`: the name `DeepSpeedZeroOptimizer`, for imports
and isinstance checks (Note [DeepSpeed's optimizer wrappers] in runtime/wrapper_names.py).
meshspeed's stages 1 and 2 are meshspeed/parallel/zero/."""

from meshspeed.compat.deepspeed.runtime.wrapper_names import DeepSpeedOptimizerName

__all__ = ["DeepSpeedZeroOptimizer"]


class DeepSpeedZeroOptimizer(DeepSpeedOptimizerName):
    """DeepSpeed's ZeRO stage 1-2 wrapper; never an engine.optimizer here."""
