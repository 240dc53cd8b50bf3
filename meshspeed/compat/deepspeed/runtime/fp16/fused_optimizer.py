"""`deepspeed.runtime.fp16.fused_optimizer`: the name `FP16_Optimizer`, for imports and
isinstance checks (Note [DeepSpeed's optimizer wrappers] in runtime/wrapper_names.py)."""

from meshspeed.compat.deepspeed.runtime.wrapper_names import DeepSpeedOptimizerName

__all__ = ["FP16_Optimizer"]


class FP16_Optimizer(DeepSpeedOptimizerName):
    """DeepSpeed's fp16 wrapper with flat fp32 masters; never an engine.optimizer here."""
