"""Fake quantization (quantize, then dequantize at once) and DeepSpeed's MoQ bit schedule.

Every function here returns a tensor of the input's shape and dtype holding values on the
quantization grid; nothing is stored as integers during training. Formulas are DeepSpeed's
(`compression/utils.py` and `runtime/quantize.py`), so a layer trained here sees the same
numbers in its forward:

    symmetric   scale = 2·max|x| / 2^b,          q = clamp(round(x / scale), -2^(b-1), 2^(b-1) - 1)
    asymmetric  scale = (max x - min x) / 2^b,   z = round(min x / scale)·scale,
                q = clamp(round((x - z) / scale), 0, 2^b - 1),  x̂ = q·scale + z
    ternary (2 bits) and binary (1 bit): Li et al. 2016 (https://arxiv.org/abs/1605.04711)
    and Rastegari et al. 2016 (XNOR-Net), symmetric only

one scale (and zero point) per group: the flattened tensor cut into `groups` equal pieces.
Gradients pass straight through (`straight_through`; Bengio et al. 2013,
https://arxiv.org/abs/1308.3432): d x̂ / d x = 1 everywhere, as in DeepSpeed.
"""

from __future__ import annotations

import torch


class _StraightThrough(torch.autograd.Function):
    """Forward: the already-quantized value. Backward: the gradient of the identity."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
        return quantized

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def straight_through(x: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
    """`quantized` in the forward, with `x`'s gradient flowing through unchanged."""
    return _StraightThrough.apply(x, quantized.detach())


def _safe(scale: torch.Tensor) -> torch.Tensor:
    # an all-zero group (a pruned row) has scale 0: any nonzero scale maps it to 0 exactly
    return torch.where(scale > 0, scale, torch.ones_like(scale))


@torch.no_grad()
def quantize_uniform(
    x: torch.Tensor,
    bits: int,
    groups: int = 1,
    symmetric: bool = True,
    stochastic: bool = False,
    lo: torch.Tensor | None = None,
    hi: torch.Tensor | None = None,
) -> torch.Tensor:
    """`bits`-bit grid values of `x`, one range per group; `lo`/`hi` give a fixed range
    (static activation calibration, one group) instead of each group's min/max.
    `stochastic` adds uniform noise in [-0.5, 0.5) before rounding (MoQ's "stochastic")."""
    levels = 2**bits
    flat = x.reshape(groups, -1)
    if lo is None:
        lo = flat.amin(dim=-1, keepdim=True)
        hi = flat.amax(dim=-1, keepdim=True)
    noise = torch.empty_like(flat).uniform_(-0.5, 0.5) if stochastic else 0.0
    if symmetric:
        scale = _safe(2 * torch.maximum(lo.abs(), hi.abs()) / levels)
        q = (flat / scale + noise).round().clamp(-(levels // 2), levels // 2 - 1) * scale
    else:
        scale = _safe((hi - lo) / levels)
        zero = (lo / scale).round() * scale
        q = ((flat - zero) / scale + noise).round().clamp(0, levels - 1) * scale + zero
    return q.reshape(x.shape)


@torch.no_grad()
def quantize_ternary(x: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """{-a, 0, a} per group: zero below 0.7·mean|x|, else ±(mean |x| of the kept entries)."""
    flat = x.reshape(groups, -1)
    thresh = 0.7 * flat.abs().mean(dim=1, keepdim=True)
    keep = (flat.abs() > thresh).to(flat.dtype)
    alpha = (keep * flat).abs().sum(dim=1, keepdim=True) / keep.sum(dim=1, keepdim=True).clamp(min=1)
    return (alpha * torch.sign(flat) * keep).reshape(x.shape)


@torch.no_grad()
def quantize_binary(x: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """{-a, a} per group, a = mean |x|."""
    flat = x.reshape(groups, -1)
    return (flat.sign() * flat.abs().mean(dim=1, keepdim=True)).reshape(x.shape)


def quantize(x: torch.Tensor, bits: int, groups: int, symmetric: bool, stochastic: bool = False):
    """The grid values of a weight at `bits` (3+ uniform, 2 ternary, 1 binary)."""
    if bits >= 3:
        return quantize_uniform(x, bits, groups, symmetric, stochastic)
    return quantize_ternary(x, groups) if bits == 2 else quantize_binary(x, groups)


# -- DeepSpeed's MoQ schedule (runtime/quantize.py, Quantizer.compute_quantization) ----------
def moq_bits(k: int, start: int, target: int, period: int) -> int:
    """Bits at the k-th quantization (k >= 1): one bit less each time k reaches the period,
    which then doubles; never below `target`. start 8, target 4, period 10: 8 until k = 9,
    7 from k = 10, 6 from 20, 5 from 40, 4 from 80 on."""
    bits = start
    while bits > target and k >= period:
        bits -= 1
        period *= 2
    return bits


def moq_real_share(k: int, start: int, target: int, period: int, change: float) -> float:
    """fp16_mixed_quantize: the share of the full-precision weight at the k-th quantization.
    It falls by `change` per quantization from 1 to 0 and is back at 1 at each bit drop."""
    drops = start - moq_bits(k, start, target, period)
    last_drop = period * 2 ** (drops - 1) if drops else 0
    return max(0.0, 1.0 - change * (k - last_drop))
