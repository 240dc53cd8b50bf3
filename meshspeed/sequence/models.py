"""Attaching a ContextParallel to the attention of a model, so the model's code does not
change: meshspeed's GPT (its Attention modules read `context`), Hugging Face models (an
attention function registered with transformers' AttentionInterface, selected through the
model's config), and models that already call DeepSpeed's DistributedAttention
themselves (their script cuts its batches, as under DeepSpeed; nothing is attached).

A model of none of these kinds is left alone too, with a warning: as in DeepSpeed, its
script builds DistributedAttention over `engine.seq_parallel_group` (often after
initialize, which is why this is not an error) and cuts its batches. Until it does,
every cp rank computes the same whole sequences and the averaged gradients are still
right, only not split.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from meshspeed import comm
from meshspeed.config.errors import ConfigError
from meshspeed.sequence.context import ContextParallel
from meshspeed.sequence.layer import DistributedAttention

log = logging.getLogger("meshspeed")

HF_NAME = "meshspeed_context_parallel"


@runtime_checkable
class ContextAttention(Protocol):
    """An attention module that runs through `context` once it is set: it takes its
    positions from it and calls `context.attend(q, k, v, causal=True)` (meshspeed's GPT
    Attention). The model offers the slot; this package fills it."""

    context: Any
    max_positions: int | None  # the longest sequence its position tables cover

    def local_heads(self) -> tuple[int, int]: ...


def attach(model: nn.Module, ctx: ContextParallel) -> bool:
    """Route the model's attention through `ctx`. Returns whether the engine cuts the
    batches (False for models with their own DistributedAttention, and others). Raises
    ConfigError for heads the method cannot split."""
    try:
        if any(isinstance(m, DistributedAttention) for m in model.modules()):
            return False
        slots = [(name, m) for name, m in model.named_modules() if isinstance(m, ContextAttention)]
        if slots:
            for name, m in slots:
                ctx.check_heads(*m.local_heads(), name)
                m.context = ctx
            ctx.max_positions = slots[0][1].max_positions
            return True
        if _attach_hf(model, ctx):
            return True
    except ValueError as err:
        raise ConfigError([f"context_parallel: {err}"]) from None
    if ctx.rank == 0 and comm.get_rank() == 0:
        log.warning("context parallelism: %s has no attention meshspeed routes by itself (meshspeed's "
                    "GPT or a transformers model); as in DeepSpeed, build DistributedAttention over "
                    "engine.seq_parallel_group and cut the batches in the script, or every cp rank "
                    "computes whole sequences", type(model).__name__)
    return False


def _attach_hf(model: nn.Module, ctx: ContextParallel) -> bool:
    try:
        from transformers import (  # lazy: optional dependency (dev extra)
            AttentionInterface,
            PreTrainedModel,
        )
    except ImportError:
        return False
    if not isinstance(model, PreTrainedModel):
        return False
    AttentionInterface.register(HF_NAME, _hf_attention)
    found = False
    for name, m in model.named_modules():
        if hasattr(m, "k_proj") and hasattr(m, "q_proj") and hasattr(m, "head_dim"):
            heads = m.q_proj.weight.shape[0] // m.head_dim
            ctx.check_heads(heads, m.k_proj.weight.shape[0] // m.head_dim, name)
            m._meshspeed_context = ctx
            found = True
    if found:
        for sub in model.modules():
            config = getattr(sub, "config", None)
            if config is not None and hasattr(config, "_attn_implementation"):
                config._attn_implementation = HF_NAME
        ctx.max_positions = None  # rotary position ids are computed, not tabled
    return found


def _hf_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: (b, h, s, d) in, (b, s, h, d) out."""
    ctx = getattr(module, "_meshspeed_context", None)
    if ctx is None:
        raise RuntimeError(f"{type(module).__name__} runs with attn_implementation {HF_NAME!r} but "
                           "was not attached to a context-parallel engine")
    if dropout:
        raise ValueError("context-parallel attention has no attention dropout; set attention_dropout 0")
    causal = getattr(module, "is_causal", True)
    out = ctx.attend(query, key, value, causal=causal, scale=scaling)
    return out.transpose(1, 2).contiguous(), None
