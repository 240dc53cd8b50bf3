"""Kernel injection (`replace_with_kernel_inject`): the model's linear layers replaced by
ones whose weights are laid out once for the device's fastest matrix multiply.

Note [prepacked weights on the CPU]
A decode step multiplies a few rows (the batch) by every weight matrix. On the CPU,
`F.linear` hands that to a general GEMM which re-reads the weight in its row-major layout
each call; oneDNN can reorder a weight once into the blocked layout its kernels stream
(`torch.ops.mkldnn._reorder_linear_weight`) and multiply against it directly
(`_linear_pointwise`). Measured on this 2-core AMD EPYC, one thread, fp32:

    (rows x in x out)      F.linear   prepacked
    8 x 384 x 1536           152 us       67 us
    8 x 1536 x 384           163 us       68 us
    8 x 384 x 8192          1002 us      296 us
    32 x 384 x 1536          448 us      200 us
    1 x 384 x 1536            37 us       45 us

so a batch of 8 or more gains 2-3x per matrix, and one row loses ~20%. The packed tensor
holds the same number of elements as the weight (the dense one is dropped), so memory does
not grow, except where the weight is shared with another module (GPT-2's lm_head and token
embedding): then the embedding keeps the dense copy and the head holds its packed one.
Results differ from `F.linear` by rounding only (relative 1e-6 in fp32: the summation
order differs), so injected models are not bit-identical to the plain ones; greedy tokens
can differ where two logits are that close.

Where it applies: CPU, fp32 or bf16, torch built with oneDNN, plain `nn.Linear` and Hugging
Face `Conv1D` (tensor-parallel and quantized layers have their own forward and are left
alone). `packed_linear_supported(device_type, dtype)` says so, and `inject_kernels` also
checks one packed layer against `F.linear` before replacing anything: a build where the op
is missing or wrong keeps the plain layers, with one rank-0 log line. On CUDA cuBLAS is
already the fast path and nothing is replaced.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("meshspeed")

ROWS_HINT = 8  # the batch the weights are laid out for; any number of rows works


def packed_linear_supported(device_type: str, dtype: torch.dtype) -> bool:
    return (device_type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's prepacked layout (Note [prepacked weights on
    the CPU]). Inference only: the packed weight is a buffer, not a parameter."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT),
                             persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)
        self.dtype = weight.dtype

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight, rebuilt on each read (code that inspects a layer's weight)."""
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, prepacked"


def _dense_weight(module: nn.Module) -> torch.Tensor | None:
    """(out, in) weight of a plain linear layer, or None for anything else."""
    if type(module) is nn.Linear:
        return module.weight
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):  # HF GPT-2: (in, out)
        return module.weight.t()
    return None


def _works(dtype: torch.dtype) -> bool:
    """One packed multiply against F.linear (Note [prepacked weights on the CPU])."""
    try:
        g = torch.Generator().manual_seed(0)
        w, x = torch.randn(24, 16, generator=g).to(dtype), torch.randn(3, 16, generator=g).to(dtype)
        got = PackedLinear(w, None)(x).float()
        want = F.linear(x, w).float()
        return torch.allclose(got, want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-4)
    except (RuntimeError, AttributeError):
        return False


def inject_kernels(model: nn.Module) -> int:
    """Replace every plain linear layer of `model` (in place) by a `PackedLinear` where the
    device and dtype support it; returns how many were replaced."""
    first = next(model.parameters(), None)
    if first is None or not packed_linear_supported(first.device.type, first.dtype):
        return 0
    if not _works(first.dtype):
        if _rank_zero():
            log.warning("replace_with_kernel_inject: oneDNN's prepacked linear is not usable in this "
                        "torch build; the plain layers stay")
        return 0
    swaps = []
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            weight = _dense_weight(child)
            if weight is not None and weight.device.type == "cpu" and weight.dtype == first.dtype:
                swaps.append((module, child_name, child, weight))
    for parent, child_name, child, weight in swaps:
        setattr(parent, child_name, PackedLinear(weight.contiguous(), child.bias))
    return len(swaps)


def _rank_zero() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
