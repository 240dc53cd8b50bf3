"""The fused operations of inference, by name, each with the plain PyTorch path.

Model runners call these functions, never the ops inside them, so that a faster version
(fused, compiled, or a device kernel) can stand in where it is supported on the device
and dtype at hand, and the plain path is used everywhere else.

(Stub: plain PyTorch paths only; the registry with support checks is the kernels piece of
issue 16.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps), computed in fp32, returned in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual add fused with the norm."""
    s = x + residual
    return rms_norm(s, weight, eps), s


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + residual
    return layer_norm(s, weight, bias, eps), s


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding (Llama/HF convention): x (..., T, D), cos/sin (..., T, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None, approximate: str = "tanh") -> torch.Tensor:
    return F.gelu(x if bias is None else x + bias, approximate=approximate)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(gate) * up."""
    return F.silu(gate) * up
