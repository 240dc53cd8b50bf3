"""Model runners: one per model family, each running the model's own modules over a KV
cache (`meshspeed.inference.protocol.Runner`). `runner_for(model)` picks the family."""

from __future__ import annotations

from torch import nn

from meshspeed.inference.runners.base import CachedRunner, Head, StepContext, attend
from meshspeed.inference.runners.gpt import GPTRunner
from meshspeed.inference.runners.gpt2 import GPT2Runner
from meshspeed.inference.runners.llama import FAMILIES as LLAMA_FAMILIES
from meshspeed.inference.runners.llama import LlamaRunner
from meshspeed.models.gpt import GPT


def runner_for(model) -> CachedRunner:
    """The runner of a meshspeed `GPT`, a Hugging Face GPT-2 or Llama-family causal LM
    (whole, or split by `apply_tensor_parallel`), or of an engine's `.module`; a runner
    is returned as is."""
    if isinstance(model, CachedRunner):
        return model
    if isinstance(model, GPT):
        return GPTRunner(model)
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family in LLAMA_FAMILIES and hasattr(model, "lm_head"):
        return LlamaRunner(model)
    if family == "gpt2" and hasattr(model, "lm_head"):
        return GPT2Runner(model)
    inner = getattr(model, "module", None)
    if isinstance(inner, nn.Module) and inner is not model:
        return runner_for(inner)
    raise TypeError(f"no inference runner for {type(model).__name__}"
                    f"{f' (model_type {family!r})' if family else ''}: supported are meshspeed's GPT "
                    f"and Hugging Face causal LMs of model_type gpt2, {', '.join(LLAMA_FAMILIES)}")


__all__ = ["CachedRunner", "GPT2Runner", "GPTRunner", "Head", "LlamaRunner", "StepContext",
           "attend", "runner_for"]
