"""Weight-only INT8 / INT4 quantization with dequantize-on-the-fly matmuls (issue 16).

`quantize_weights(model, bits, group_size)` swaps, in place, every nn.Linear, Hugging
Face Conv1D (GPT-2's linear, weight stored (in, out)) and tensor-parallel column/row layer
for a module that keeps its weight as integers plus scales and rebuilds the float weight
inside each forward call. Activations, embeddings, norms and biases stay in the model's
dtype. `weight_bytes(model)` counts what the quantized weights occupy.

Note [symmetric absmax quantization]
Each output channel (group_size None) or each run of `group_size` consecutive input
elements of an output channel (a "group") gets one scale s = max|w| / qmax with qmax 127
(INT8) or 7 (INT4), and q = round(w / s), so q lies in [-qmax, qmax] with no clamping
needed: the largest |w| maps to exactly ±qmax. Then |q*s - w| <= s/2 for every element
(round-to-nearest), which the tests check element by element. Symmetric (no zero point)
because trained weights are centred on zero and it keeps the dequantization one multiply.
INT4 uses the 15 levels -7..7 (not -8) so that the grid stays symmetric. A group of all
zeros gets s = 0 and q = 0. Scales are fp32 by default (`scale_dtype`): a bf16 scale
carries a relative error up to 2^-9, which times qmax = 127 is a quarter of a step, so the
half-step bound would no longer hold.
group_size must divide in_features (a clear error names the layer otherwise): padding the
last group would make a layer's scale count depend on a rounding rule nobody asked for.

Note [INT4 packing]
Two INT4 values per uint8 byte along the input dimension: element 2j in the low nibble
and 2j+1 in the high nibble, each stored as q + 8 (1..15, so 0 never holds a value). An
odd in_features gets one zero nibble of padding at the end of each row, so a row takes
ceil(in/2) bytes.

Note [quantized weight bytes]
For a layer with `out` output and `in` input features, g = group_size (in if None) and
b = bytes of one scale (4 for fp32):
    INT8: out * in          + b * out * (in / g)
    INT4: out * ceil(in/2)  + b * out * (in / g)
against 4 * out * in in fp32, so the ratio is 1/4 + b/(4g) (INT8) and 1/8 + b/(4g) (INT4,
even in). weight_bytes sums this over the quantized layers; biases are not counted (they
stay full precision and are the same either way).

Note [dequantize per call]
forward rebuilds W = q * s in the input's dtype and runs F.linear, then drops W, so at
most one layer's float weight is alive at a time, never the whole model's. The output
features are processed `chunk_rows` rows at a time (F.linear per chunk, outputs
concatenated; same result up to GEMM blocking), bounding the temporary to
chunk_rows * in elements. chunk_rows=None picks by device: on CPU, rows of about
CPU_CHUNK_ELEMENTS (2^18, a 1 MiB fp32 temporary that stays in cache) -- measured on a
1024x4096 INT8 layer, one thread, batch 1: whole-layer rebuild 18 ms, 2^18-element chunks
1.1 ms, the fp32 nn.Linear 0.7 ms (2^14: 9 ms, 2^20: 0.8 ms, 2^22: 35 ms; a loaded 2-core
machine, best of 20), because a 16 MiB temporary is fresh memory each call; on other
devices the whole layer at once (fewer kernel launches; not measured here, no GPU). The
rebuild costs a read of the int weights and a write of the float ones per call, so this
trades speed for memory; speed from INT8 needs a kernel that dequantizes in registers
(decode at small batch is bound by reading weights, and INT8 reads 4x fewer bytes than
fp32) -- not written here.

Note [no float weight in the graph]
Under autograd (an input or a bias that requires grad), F.linear saves its weight for the
input's gradient, so the rebuilt float weight of every layer would stay alive for as long
as the caller keeps the output: a teacher-forced `logits = engine(ids).logits` held the
whole model's fp32 weights again (issue 34: every live tensor summed to 1.4x the fp32
model). QuantizedLinear therefore runs its matmul in an autograd Function that saves
nothing but a reference to the layer, whose integer weight is resident anyway, and
rebuilds W chunk by chunk in backward (grad_x = grad_y @ W; the weight has no gradient).
Gradients with respect to the input stay exact; backward pays a second rebuild.
QuantizedParallelLinear (below) calls the wrapped layer's forward, whose F.linear saves
the rebuilt local weight when its input requires grad; init_inference freezes the model's
parameters, so that only happens for inputs the caller made differentiable.

Note [tied weights stay full precision]
A linear whose weight Parameter is shared with another module (GPT-2's lm_head and wte,
the vocab-parallel head tied to the split embedding) is left alone: the embedding keeps
the full-precision Parameter anyway, so a quantized copy would add bytes, not save them,
and the head is the layer whose error reaches the logits undamped.

Note [quantizing tensor-parallel layers]
ColumnParallelLinear / RowParallelLinear keep only this rank's slice of the weight and do
their own communication around a matmul with `self.weight`. QuantizedParallelLinear
quantizes that local slice (in its (out, in) view; a row layer's groups then lie within
the rank's input features, so with a group_size dividing the local width the result
equals quantizing the whole layer with that group size) and calls the wrapped layer with
the rebuilt weight swapped in for the call (torch.func.functional_call), so all of the
layer's collectives run unchanged. Its own `weight` becomes an empty Parameter. Sibling
column layers that shared one input gather (SharedGather, Note [one gather for sibling
column layers]) are detached from it: the sharing saves communication in backward and
sequence-parallel gathers, and each layer then does its own, with the same result. The
local weight is rebuilt whole each call (1/tp of the layer; the matmul sits inside the
layer's communication, so it is not chunked).
"""

from __future__ import annotations

import fnmatch
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_QMAX = {8: 127, 4: 7}
CPU_CHUNK_ELEMENTS = 1 << 18  # Note [dequantize per call]


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (weight (in, out)), recognised without importing transformers."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _is_parallel_linear(module: nn.Module) -> bool:
    return hasattr(module, "tp_shards") and hasattr(module, "weight_layout") and hasattr(module, "group")


def _check_options(bits: int, group_size: int | None) -> None:
    if bits not in _QMAX:
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int)
                                   or group_size < 1):
        raise ValueError(f"group_size must be a positive integer or None (per output channel), "
                         f"got {group_size!r}")


# ---------------------------------------------------------------------------------------
# tensors: quantize, pack, dequantize


def quantize_tensor(weight: torch.Tensor, bits: int = 8, group_size: int | None = None, *,
                    scale_dtype: torch.dtype = torch.float32,
                    name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) for a weight (out, in): q int8 (out, in) for INT8 or uint8
    (out, ceil(in/2)) for INT4 (Note [INT4 packing]); scale (out, in // group_size).
    Note [symmetric absmax quantization]."""
    _check_options(bits, group_size)
    if weight.dim() != 2:
        raise ValueError(f"{name} must be 2-D (out, in), got shape {tuple(weight.shape)}")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError(f"{name} holds inf or NaN values; only finite weights can be quantized")
    out_f, in_f = weight.shape
    g = in_f if group_size is None else group_size
    if in_f % g:
        raise ValueError(f"group_size {g} does not divide {name}'s {in_f} input features; "
                         f"pick a divisor of {in_f} or group_size=None (per output channel)")
    w = weight.detach().float().reshape(out_f, in_f // g, g)
    scale = w.abs().amax(dim=-1) / _QMAX[bits]  # (out, groups)
    scale = scale.to(scale_dtype).float()  # quantize against the scale that will be stored
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / safe.unsqueeze(-1)).clamp_(-_QMAX[bits], _QMAX[bits])
    q = q.to(torch.int8).reshape(out_f, in_f)
    return (q if bits == 8 else pack_int4(q)), scale.to(scale_dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-7, 7], (out, in) -> uint8 (out, ceil(in/2)); Note [INT4 packing]."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    if u.shape[-1] % 2:
        u = F.pad(u, (0, 1), value=0)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """uint8 (out, ceil(in/2)) -> int8 (out, in); the inverse of pack_int4."""
    low = (packed & 0x0F).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack((low, high), dim=-1).flatten(-2)[..., :in_features]


def dequantize(q: torch.Tensor, scale: torch.Tensor, bits: int, in_features: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight (out, in) in `dtype` from quantize_tensor's (q, scale).

    The product q * s is formed in fp32 (or in `dtype` if that is wider) and rounded to
    `dtype` once: a bf16 product of a bf16-rounded scale would round twice."""
    ints = q if bits == 8 else unpack_int4(q, in_features)
    rows, groups = scale.shape
    work = dtype if dtype == torch.float64 else torch.float32
    w = ints.to(work).reshape(rows, groups, in_features // groups) * scale.to(work).unsqueeze(-1)
    return w.reshape(rows, in_features).to(dtype)


# ---------------------------------------------------------------------------------------
# modules


class QuantizedLinear(nn.Module):
    """y = x @ (q * s)^T + b with W rebuilt per call (Note [dequantize per call]).

    Buffers `qweight` (int8 (out, in) or packed uint8 (out, ceil(in/2))) and `scale`
    ((out, in // group_size), scale_dtype); `bias` a frozen Parameter in the original
    dtype, or None. Inference only: nothing here has a gradient. Cast a model to its
    serving dtype before quantizing it: Module.to(dtype) casts floating buffers, so it
    would turn the fp32 scales into that dtype too (Note [symmetric absmax quantization])."""

    def __init__(self, in_features: int, out_features: int, bits: int = 8,
                 group_size: int | None = None, *, bias: bool = True,
                 scale_dtype: torch.dtype = torch.float32, dtype: torch.dtype = torch.float32,
                 device: Any = None, chunk_rows: int | None = None) -> None:
        super().__init__()
        _check_options(bits, group_size)
        g = in_features if group_size is None else group_size
        if in_features % g:
            raise ValueError(f"group_size {g} does not divide in_features {in_features}")
        if chunk_rows is not None and chunk_rows < 1:
            raise ValueError(f"chunk_rows must be a positive integer or None, got {chunk_rows!r}")
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size, self.chunk_rows = bits, group_size, chunk_rows
        cols, qdtype = (in_features, torch.int8) if bits == 8 else ((in_features + 1) // 2, torch.uint8)
        self.register_buffer("qweight", torch.zeros(out_features, cols, dtype=qdtype, device=device))
        self.register_buffer("scale", torch.zeros(out_features, in_features // g, dtype=scale_dtype,
                                                  device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device),
                                     requires_grad=False)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_module(cls, module: nn.Module, bits: int = 8, group_size: int | None = None, *,
                    scale_dtype: torch.dtype = torch.float32, chunk_rows: int | None = None,
                    name: str = "weight") -> QuantizedLinear:
        """Quantize an nn.Linear (weight (out, in)) or a Conv1D (weight (in, out))."""
        w = module.weight.detach()
        w = w.t() if _is_conv1d(module) else w
        out_f, in_f = w.shape
        layer = cls(in_f, out_f, bits, group_size, bias=module.bias is not None,
                    scale_dtype=scale_dtype, dtype=module.weight.dtype, device=w.device,
                    chunk_rows=chunk_rows)
        q, s = quantize_tensor(w, bits, group_size, scale_dtype=scale_dtype, name=name)
        layer.qweight.copy_(q)
        layer.scale.copy_(s)
        if module.bias is not None:
            layer.bias.data.copy_(module.bias.detach())
        return layer

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: slice = slice(None)) -> torch.Tensor:
        """The float weight (out, in) (or the given rows of it) in `dtype`."""
        return dequantize(self.qweight[rows], self.scale[rows], self.bits, self.in_features, dtype)

    def rows_per_chunk(self, device: torch.device) -> int:
        """Output rows rebuilt per F.linear on `device` (Note [dequantize per call])."""
        if self.chunk_rows is not None:
            return self.chunk_rows
        if device.type == "cpu":
            return max(1, CPU_CHUNK_ELEMENTS // self.in_features)
        return self.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.bias is None or self.bias.dtype == x.dtype else self.bias.to(x.dtype)
        if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
            return _QuantizedMatmul.apply(x, bias, self)  # Note [no float weight in the graph]
        return self.matmul(x, bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W^T + bias, W rebuilt `rows_per_chunk` output rows at a time."""
        step = self.rows_per_chunk(x.device)
        if step >= self.out_features:
            return F.linear(x, self.dequantize(x.dtype), bias)
        outs = []
        for start in range(0, self.out_features, step):
            rows = slice(start, start + step)
            outs.append(F.linear(x, self.dequantize(x.dtype, rows), None if bias is None else bias[rows]))
        return torch.cat(outs, dim=-1)

    def input_grad(self, grad_y: torch.Tensor) -> torch.Tensor:
        """grad_y @ W, W rebuilt in the same row chunks as the forward."""
        step = self.rows_per_chunk(grad_y.device)
        grad_x = None
        for start in range(0, self.out_features, step):
            rows = slice(start, start + step)
            part = grad_y[..., rows] @ self.dequantize(grad_y.dtype, rows)
            grad_x = part if grad_x is None else grad_x.add_(part)
        return grad_x

    def weight_bytes(self) -> int:
        """Bytes of qweight + scale (Note [quantized weight bytes])."""
        return self.qweight.nbytes + self.scale.nbytes

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bits={self.bits}, group_size={self.group_size}, bias={self.bias is not None}")


class _QuantizedMatmul(torch.autograd.Function):
    """QuantizedLinear's matmul under autograd, saving no float weight (Note [no float
    weight in the graph]): backward rebuilds W from the layer's integers."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor | None, layer: QuantizedLinear) -> torch.Tensor:
        ctx.layer = layer
        ctx.has_bias = bias is not None
        return layer.matmul(x, bias)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        grad_x = ctx.layer.input_grad(grad_y) if ctx.needs_input_grad[0] else None
        grad_b = None
        if ctx.has_bias and ctx.needs_input_grad[1]:
            grad_b = grad_y.reshape(-1, grad_y.shape[-1]).sum(0)
        return grad_x, grad_b, None


class QuantizedParallelLinear(nn.Module):
    """A ColumnParallelLinear / RowParallelLinear whose local weight is held quantized;
    Note [quantizing tensor-parallel layers]. `inner` is the wrapped layer (its
    communication, bias and tp_shards unchanged, its `weight` an empty Parameter)."""

    def __init__(self, layer: nn.Module, bits: int = 8, group_size: int | None = None, *,
                 scale_dtype: torch.dtype = torch.float32, name: str = "weight") -> None:
        super().__init__()
        w = layer.weight.detach()
        self.transposed = layer.weight_layout == "in_out"
        w = w.t() if self.transposed else w
        self.bits, self.group_size = bits, group_size
        self.out_local, self.in_local = w.shape
        q, s = quantize_tensor(w, bits, group_size, scale_dtype=scale_dtype, name=name)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", s)
        shared = getattr(layer, "shared_gather", None)
        if shared is not None and hasattr(shared, "output"):  # a SharedGather of siblings
            shared.members = [m for m in shared.members if m is not layer]
            layer.shared_gather = None
        layer.weight = nn.Parameter(w.new_empty(0), requires_grad=False)
        if layer.bias is not None:
            layer.bias.requires_grad_(False)
        self.inner = layer

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The local weight (out_local, in_local) in `dtype`."""
        return dequantize(self.qweight, self.scale, self.bits, self.in_local, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.dequantize(x.dtype)
        return torch.func.functional_call(self.inner, {"weight": w.t() if self.transposed else w}, (x,))

    def weight_bytes(self) -> int:
        return self.qweight.nbytes + self.scale.nbytes

    def extra_repr(self) -> str:
        return f"bits={self.bits}, group_size={self.group_size}, local=({self.out_local}, {self.in_local})"


# ---------------------------------------------------------------------------------------
# the model-level pass


def quantize_weights(model: nn.Module, bits: int = 8, group_size: int | None = None, *,
                     skip: tuple[str, ...] | list[str] = (), scale_dtype: torch.dtype = torch.float32,
                     chunk_rows: int | None = None) -> nn.Module:
    """Quantize `model`'s linear layers in place (weight-only, symmetric); returns `model`.

    Replaced: nn.Linear and HF Conv1D by QuantizedLinear, tensor-parallel column/row layers
    by QuantizedParallelLinear. Left in full precision: modules whose name matches a
    pattern in `skip` (fnmatch, e.g. "lm_head", "*.mlp.*"), embeddings and everything that
    is not a linear, linears whose weight is tied to another module (Note [tied
    weights stay full precision]) and nn.MultiheadAttention's out_proj (read, not called). bits: 8 or 4. group_size: None for one scale per output
    channel, else one per `group_size` input elements (must divide every quantized layer's
    input width -- for a row-parallel layer, its local width). chunk_rows: see Note
    [dequantize per call]. Every layer is checked before any is replaced.
    """
    _check_options(bits, group_size)
    if isinstance(skip, str):
        skip = (skip,)
    done = [n for n, m in model.named_modules() if isinstance(m, (QuantizedLinear, QuantizedParallelLinear))]
    if done:
        raise ValueError(f"{type(model).__name__} already has quantized layers ({done[0]}, ...); "
                         "quantize_weights runs once per model, on its full-precision weights")
    names = [n for n, _ in model.named_modules() if n]
    unmatched = [pat for pat in skip if not any(fnmatch.fnmatchcase(n, pat) for n in names)]
    if unmatched:
        raise ValueError(f"skip pattern(s) {unmatched} match no module of {type(model).__name__}; "
                         "patterns are fnmatch globs on full module names such as 'lm_head' or "
                         "'*.mlp.down_proj'")
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    todo = []
    for name, module in model.named_modules():
        if not name or any(fnmatch.fnmatchcase(name, pat) for pat in skip):
            continue
        kind = _kind(module)
        if kind is None or uses.get(id(module.weight), 0) > 1 or _read_by_parent(model, name):
            continue
        todo.append((name, module, kind))
    problems = [p for p in (_problem(n, m, k, group_size) for n, m, k in todo) if p]
    if problems:
        raise ValueError("cannot quantize: " + "; ".join(problems))
    for name, module, kind in todo:
        if kind == "parallel":
            new = QuantizedParallelLinear(module, bits, group_size, scale_dtype=scale_dtype,
                                          name=f"{name}.weight")
        else:
            new = QuantizedLinear.from_module(module, bits, group_size, scale_dtype=scale_dtype,
                                              chunk_rows=chunk_rows, name=f"{name}.weight")
        _replace(model, name, new)
    return model


def _kind(module: nn.Module) -> str | None:
    if _is_parallel_linear(module):
        return "parallel"
    if isinstance(module, nn.Linear) or _is_conv1d(module):
        return "linear"
    return None


def _read_by_parent(model: nn.Module, name: str) -> bool:
    """nn.MultiheadAttention reads its out_proj's weight itself instead of calling it, so a
    replacement would never run: such linears stay full precision."""
    parent_name = name.rpartition(".")[0]
    parent = model.get_submodule(parent_name) if parent_name else model
    return isinstance(parent, nn.MultiheadAttention)


def _problem(name: str, module: nn.Module, kind: str, group_size: int | None) -> str | None:
    rows, cols = module.weight.shape
    transposed = _is_conv1d(module) or (kind == "parallel" and module.weight_layout == "in_out")
    in_f = rows if transposed else cols
    if group_size is not None and in_f % group_size:
        where = "local input features" if kind == "parallel" else "input features"
        return (f"group_size {group_size} does not divide {name}'s {in_f} {where}; pick a "
                f"divisor of {in_f}, skip the layer, or use group_size=None")
    if module.weight.device.type == "meta":
        return f"{name}'s weight is on the meta device (materialize the model before quantizing)"
    return None


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every quantized layer's integer weight and scales (Note [quantized weight
    bytes]); 0 for a model with no quantized layer."""
    return sum(m.weight_bytes() for m in model.modules()
               if isinstance(m, (QuantizedLinear, QuantizedParallelLinear)))


def expected_weight_bytes(out_features: int, in_features: int, bits: int, group_size: int | None,
                          scale_bytes: int = 4) -> int:
    """The formula of Note [quantized weight bytes] for one layer."""
    _check_options(bits, group_size)
    per_row = in_features if bits == 8 else math.ceil(in_features / 2)
    groups = 1 if group_size is None else in_features // group_size
    return out_features * per_row + scale_bytes * out_features * groups
