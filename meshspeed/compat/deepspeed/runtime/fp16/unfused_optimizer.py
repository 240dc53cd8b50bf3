"""`deepspeed.runtime.fp16.unfused_optimizer`: the path of DeepSpeed's fp16/bf16 wrapper
around a client optimizer at ZeRO stage 0.

meshspeed wraps nothing: the engine keeps the fp32 master weights and the loss scale
(meshspeed/optim/precision.py), and `engine.optimizer` is the optimizer the script passed
or the config named. So nothing is an instance of `FP16_UnfusedOptimizer`, and building
one says where its parts are.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FP16_UnfusedOptimizer"]


class FP16_UnfusedOptimizer:  # DeepSpeed's name
    """DeepSpeed's stage-0 half-precision wrapper; meshspeed has no wrapper (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any):
        raise NotImplementedError(
            "meshspeed does not wrap optimizers for fp16/bf16: pass the optimizer to "
            "deepspeed.initialize with fp16 or bf16 enabled in the config, and the engine keeps the "
            "master weights and loss scale (engine.loss_scale)")
