"""`deepspeed.runtime.zero.stage3`: the name `DeepSpeedZeroOptimizer_Stage3`, for imports
and isinstance checks (Note [DeepSpeed's optimizer wrappers] in runtime/wrapper_names.py).
meshspeed's stage 3 is meshspeed/parallel/zero/."""

from meshspeed.compat.deepspeed.runtime.wrapper_names import DeepSpeedOptimizerName

__all__ = ["DeepSpeedZeroOptimizer_Stage3"]


class DeepSpeedZeroOptimizer_Stage3(DeepSpeedOptimizerName):
    """DeepSpeed's ZeRO stage 3 wrapper; never an engine.optimizer here."""
