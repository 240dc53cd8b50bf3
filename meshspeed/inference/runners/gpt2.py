"""Runner for Hugging Face GPT-2 (`GPT2LMHeadModel`): learned positions, pre-norm
LayerNorm, fused q|k|v Conv1D projection, GELU MLP."""

from __future__ import annotations

from torch import nn

from meshspeed.inference import kernels
from meshspeed.inference.runners.base import (
    CachedRunner,
    Head,
    StepContext,
    attend,
    check_supported,
    heads,
)

_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def _ln(x, norm: nn.Module):
    return kernels.layer_norm(x, norm.weight, norm.bias, norm.eps)


class GPT2Embed(nn.Module):
    def __init__(self, wte: nn.Module, wpe: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe = wte, wpe

    def forward(self, ids, positions):
        return self.wte(ids) + self.wpe(positions)


class GPT2CachedLayer(nn.Module):
    """One GPT2Block's step over the cache."""

    def __init__(self, block: nn.Module, index: int, head_dim: int, activation: str) -> None:
        super().__init__()
        self.block, self.index, self.head_dim = block, index, head_dim
        if block.attn.reorder_and_upcast_attn or getattr(block, "crossattention", None) is not None:
            raise ValueError("GPT-2 layers with reorder_and_upcast_attn or cross-attention are not "
                             "supported by the cached runner")
        self.scale = block.attn.scaling  # 1/sqrt(hd), / (layer + 1) with inverse-layer scaling
        self.tanh_gelu = activation in _TANH_GELU

    def forward(self, x, ctx: StepContext):
        b, a, mlp = self.block, self.block.attn, self.block.mlp
        qkv = a.c_attn(_ln(x, b.ln_1))  # (B, T, 3 * local width): this rank's q|k|v
        q, k, v = (heads(t, self.head_dim) for t in qkv.split(qkv.shape[-1] // 3, dim=-1))
        k, v = ctx.cache.update(self.index, ctx.step, k, v)
        y = a.c_proj(attend(q, k, v, ctx.step, self.scale))
        h, x = kernels.add_layer_norm(y, x, b.ln_2.weight, b.ln_2.bias, b.ln_2.eps)
        f = mlp.c_fc(h)
        f = kernels.bias_gelu(f, None, "tanh") if self.tanh_gelu else mlp.act(f)
        return x + mlp.c_proj(f)


class GPT2Runner(CachedRunner):
    def __init__(self, model: nn.Module) -> None:
        check_supported(model)
        config, base = model.config, model.transformer
        head_dim = config.hidden_size // config.num_attention_heads
        layers = [GPT2CachedLayer(b, i, head_dim, config.activation_function)
                  for i, b in enumerate(base.h)]
        head = Head(base.ln_f, model.lm_head, config.vocab_size, _ln)
        device = next(model.parameters()).device
        super().__init__(GPT2Embed(base.wte, base.wpe), layers, head, config.vocab_size,
                         config.n_positions, device)
