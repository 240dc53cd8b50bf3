"""Runner for Hugging Face Llama-family causal LMs (model_type llama, mistral, qwen2):
pre-norm RMSNorm layers, rotary positions, grouped-query attention, SwiGLU MLP.

Sliding-window attention (Mistral; Qwen2 with use_sliding_window) is not applied: the
runner's `max_positions` is capped at the window instead, so no sequence grows past it
and full attention is exact.
"""

from __future__ import annotations

from torch import nn

from meshspeed.inference import kernels
from meshspeed.inference.runners.base import (
    CachedRunner,
    Head,
    StepContext,
    TokenEmbed,
    attend,
    check_supported,
    heads,
)

FAMILIES = ("llama", "mistral", "qwen2")


def _rms(x, norm: nn.Module):
    return kernels.rms_norm(x, norm.weight, norm.variance_epsilon)


class LlamaCachedLayer(nn.Module):
    """One HF decoder layer's step over the cache."""

    def __init__(self, layer: nn.Module, index: int, silu: bool) -> None:
        super().__init__()
        self.layer, self.index, self.silu = layer, index, silu
        self.head_dim, self.scale = layer.self_attn.head_dim, layer.self_attn.scaling

    def forward(self, x, ctx: StepContext):
        a, mlp, hd = self.layer.self_attn, self.layer.mlp, self.head_dim
        h = _rms(x, self.layer.input_layernorm)
        q, k, v = (heads(t, hd) for t in kernels.fused_qkv(h, a.q_proj, a.k_proj, a.v_proj))
        q, k = kernels.rotary(q, ctx.cos, ctx.sin), kernels.rotary(k, ctx.cos, ctx.sin)
        k, v = ctx.cache.update(self.index, ctx.step, k, v)
        y = a.o_proj(attend(q, k, v, ctx.step, self.scale))
        post = self.layer.post_attention_layernorm
        h, x = kernels.add_rms_norm(y, x, post.weight, post.variance_epsilon)
        gate, up = mlp.gate_proj(h), mlp.up_proj(h)
        act = kernels.silu_mul(gate, up) if self.silu else mlp.act_fn(gate) * up
        return x + mlp.down_proj(act)


class LlamaRunner(CachedRunner):
    def __init__(self, model: nn.Module) -> None:
        check_supported(model)
        config = model.config
        base = model.model
        self.rotary_emb = base.rotary_emb
        silu = getattr(config, "hidden_act", "silu") == "silu"
        layers = [LlamaCachedLayer(layer, i, silu) for i, layer in enumerate(base.layers)]
        head = Head(base.norm, model.lm_head, config.vocab_size, _rms)
        limit = config.max_position_embeddings
        window = getattr(config, "sliding_window", None)
        if window and getattr(config, "use_sliding_window", True):
            limit = min(limit, window)
        device = next(model.parameters()).device
        super().__init__(TokenEmbed(base.embed_tokens), layers, head, config.vocab_size, limit, device)

    def context(self, cache, step, x) -> StepContext:
        cos, sin = self.rotary_emb(x, step.positions)  # (B, T, head_dim) each, once per step
        return StepContext(cache, step, cos[:, None], sin[:, None])
