"""Activations and their gradients between stages, sent compressed (`pipeline.activation_compression`).

    buf = encode(x, "int8")                       # what goes on the link
    y = decode(buf, x.shape, x.dtype, "int8")     # what the next stage gets

Note [compressed activations between stages]
"bf16" casts an fp32 (or fp64) tensor to bfloat16 on send and back on receive: half the
bytes, each element off by at most 2^-8 of itself (round to nearest, 8 significand
bits). A tensor already 2 bytes wide (fp16, bf16) is sent as it is: bf16 would not save
a byte, and for fp16 it would lose 3 bits.
"int8" quantizes every floating tensor per token, that is per row of its last dim
(x.shape[-1] elements, d_model for a hidden state): scale = max|row| / 127 in fp32, q =
round(x / scale) in int8, and the receiver takes q * scale in the tensor's dtype. An
element is off by at most scale / 2 = max|row| / 254 (a row of zeros is exact). The
link carries one flat uint8 buffer: the fp32 scales first (4 bytes per row, aligned at
offset 0 so they can be viewed as fp32), then the int8 values: numel + 4 * rows bytes,
against 4 * numel in fp32. A row holding inf or nan arrives as all nan (its scale is not
finite and 0 * inf is nan), so an fp16 overflow is still seen by the loss scaler.
Integer and boolean tensors (masks, ids) are never compressed. The receiver allocates its
buffer from the header (the original shape and dtype) and the mode, which the header
carries too (p2p.py, Note [shapes once, checked every micro-batch]); gradients go back
in the mode of their activation.
"""

from __future__ import annotations

import math

import torch

MODES = ("none", "bf16", "int8")
_SCALE = torch.float32  # 4 bytes per row


def wire_mode(dtype: torch.dtype, mode: str) -> str:
    """How a tensor of `dtype` travels under `mode`: "none", "bf16" or "int8"."""
    if mode not in MODES:
        raise ValueError(f"activation compression {mode!r}: expected one of {MODES}")
    if not dtype.is_floating_point or mode == "none":
        return "none"
    if mode == "bf16" and dtype.itemsize <= 2:
        return "none"
    return mode


def _rows(shape: torch.Size) -> int:
    return math.prod(shape[:-1]) if len(shape) else 1


def _matrix(shape: torch.Size) -> tuple[int, int]:
    """(tokens, elements per token) of a tensor of `shape`."""
    return _rows(shape), (shape[-1] if len(shape) else 1)


def wire_spec(shape: torch.Size, dtype: torch.dtype, wire: str) -> tuple[torch.Size, torch.dtype]:
    """(shape, dtype) of the buffer a tensor of `shape`, `dtype` travels in as `wire`."""
    if wire == "none":
        return shape, dtype
    if wire == "bf16":
        return shape, torch.bfloat16
    return torch.Size([_SCALE.itemsize * _rows(shape) + math.prod(shape)]), torch.uint8


def wire_bytes(shape: torch.Size, dtype: torch.dtype, mode: str) -> int:
    """Bytes on the link for one tensor (the header and gradient flags not included)."""
    s, d = wire_spec(shape, dtype, wire_mode(dtype, mode))
    return math.prod(s) * d.itemsize


def encode(t: torch.Tensor, wire: str) -> torch.Tensor:
    """The contiguous buffer `t` travels in (Note [compressed activations between stages])."""
    t = t.detach()
    if wire == "none":
        return t.contiguous()
    if wire == "bf16":
        return t.to(torch.bfloat16).contiguous()
    rows = t.reshape(_matrix(t.shape)).to(_SCALE)
    scale = rows.abs().amax(dim=1) / 127 if rows.shape[1] else rows.new_zeros(rows.shape[0])
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)  # a row of zeros stays zeros
    q = torch.round(rows / safe[:, None]).clamp_(-127, 127).nan_to_num_(0).to(torch.int8)
    buf = torch.empty(wire_spec(t.shape, t.dtype, wire)[0], dtype=torch.uint8, device=t.device)
    n = _SCALE.itemsize * rows.shape[0]
    buf[:n] = scale.contiguous().view(torch.uint8)
    buf[n:] = q.reshape(-1).view(torch.uint8)
    return buf


def decode(buf: torch.Tensor, shape: torch.Size, dtype: torch.dtype, wire: str) -> torch.Tensor:
    """The tensor of `shape` and `dtype` that `buf` (from encode) stands for."""
    if wire == "none":
        return buf
    if wire == "bf16":
        return buf.to(dtype)
    rows, per_row = _matrix(shape)
    n = _SCALE.itemsize * rows
    scale = buf[:n].view(_SCALE)
    q = buf[n:].view(torch.int8).reshape(rows, per_row)
    return (q.to(_SCALE) * scale[:, None]).to(dtype).reshape(shape)
