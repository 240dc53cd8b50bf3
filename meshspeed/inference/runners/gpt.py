"""Runner for meshspeed's reference `GPT` (meshspeed.models.gpt): RMSNorm, rotary,
grouped-query attention, SwiGLU or MoE MLP."""

from __future__ import annotations

import torch
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


def _rms(x, norm: nn.Module):
    return kernels.rms_norm(x, norm.weight, norm.eps)


class GPTCachedLayer(nn.Module):
    """One `Block`'s step over the cache. An MoE block's MLP is called whole (its router
    and experts are the MoE layer's business); its l_aux is dropped."""

    def __init__(self, block: nn.Module, index: int) -> None:
        super().__init__()
        self.block, self.index = block, index
        self.head_dim = block.attn.head_dim
        self.scale = self.head_dim ** -0.5
        self.dense = hasattr(block.mlp, "w1")

    def forward(self, x, ctx: StepContext):
        b, a, hd = self.block, self.block.attn, self.head_dim
        h = _rms(x, b.attn_norm)
        q, k, v = (heads(t, hd) for t in kernels.fused_qkv(h, a.wq, a.wk, a.wv))
        q, k = kernels.rotary(q, ctx.cos, ctx.sin), kernels.rotary(k, ctx.cos, ctx.sin)
        k, v = ctx.cache.update(self.index, ctx.step, k, v)
        x = x + a.wo(attend(q, k, v, ctx.step, self.scale))
        h = _rms(x, b.mlp_norm)
        if self.dense:
            m = b.mlp
            return x + m.w2(kernels.silu_mul(m.w1(h), m.w3(h)))
        y, _, _ = b.mlp(h)
        return x + y


class GPTRunner(CachedRunner):
    def __init__(self, model: nn.Module) -> None:
        check_supported(model)
        cfg = model.config
        self.rotary_tables = model.layers[0].attn.rotary  # every layer's tables are the same
        layers = [GPTCachedLayer(b, i) for i, b in enumerate(model.layers)]
        head = Head(model.norm, model.lm_head, cfg.vocab_size, _rms)
        device = next(model.parameters()).device
        super().__init__(TokenEmbed(model.tok_emb), layers, head, cfg.vocab_size, cfg.max_seq_len, device)

    def context(self, cache, step, x) -> StepContext:
        # the tables hold the half-width angles; rotate-half wants them twice over
        r = self.rotary_tables
        cos = r.cos[step.positions].to(x.dtype)  # (B, T, hd / 2)
        sin = r.sin[step.positions].to(x.dtype)
        return StepContext(cache, step, torch.cat((cos, cos), -1)[:, None], torch.cat((sin, sin), -1)[:, None])
