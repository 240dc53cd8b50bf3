"""Reference models. nanoGPT-readable; no parallel code inside."""

from meshspeed.models.gpt import (
    GPT,
    Attention,
    Block,
    GPTConfig,
    RMSNorm,
    Rotary,
    SwiGLU,
    param_count,
)

__all__ = ["GPT", "Attention", "Block", "GPTConfig", "RMSNorm", "Rotary", "SwiGLU", "param_count"]
