"""The fused operations of inference, by name, behind a registry of implementations.

Model runners call these functions, never the ops inside them, so that a faster version
(fused, compiled, or a device kernel) stands in where it is supported on the device and
dtype at hand, and the plain PyTorch path runs everywhere else:

    y = kernels.rms_norm(x, weight, eps)          # dispatches on x.device.type, x.dtype
    q, k, v = kernels.fused_qkv(x, q_proj, k_proj, v_proj)
    kernels.describe()                             # {op: {"cpu/torch.float32": "plain", ...}}
    with kernels.use("plain"):                     # or MESHSPEED_KERNELS=plain
        ...                                        # the reference path only
    kernels.register("silu_mul", my_fn, lambda device, dtype: device == "cuda", priority=20)

Note [which implementation runs]
Every op has its plain implementation (the reference: always supported, never replaced)
and any number of faster ones, each with `supports(device_type, dtype) -> bool` (runs
correctly there), `prefer` (worth running there: measured faster; by default the same)
and a priority. The first call of an op on a (device type, dtype) picks the
highest-priority implementation that supports and prefers it (under `use(label)`: that
label wherever it is supported) and remembers the pick for that key, so later calls cost
one dict lookup. A faster implementation's first call on a key is tried: if it raises
(torch.compile without a working C++ compiler, a Triton kernel on a GPU it was not built
for), it is remembered as unsupported for that key, rank 0 logs one line, and the plain
path answers this call and every later one. If the plain path raises as well, the input
was at fault, not the implementation: the plain path's error is raised and nothing is
remembered. Only the first call is guarded; a later failure is a bug and propagates.
An implementation registered with `min_numel` leaves smaller inputs to the plain path, and
its first call is its first on an input at least that large.

Note [where torch.compile pays]
`torch.compile` fuses an op's elementwise chain into one pass over memory, but each call
of a compiled function pays guard checks and a dispatch of its own (10-20 us on this CPU)
and the first call of each new (op, dtype) a compilation (1 s; the first in a process
15-40 s). Measured on the 2-core CPU of the development machine, one intra-op thread,
shared with other jobs (`python benchmarks/inference_kernels.py`: fastest of 15 interleaved runs
of 20 calls, us per call, plain / compiled; decode (8, 1, 512), prefill (8, 128, 512)):

    op              dtype     decode        prefill
    rms_norm        fp32      11.7 / 22.3    607 /   865
    rms_norm        bf16      14.7 / 25.8    981 /   165   compiled
    add_rms_norm    fp32      20.7 / 39.1    348 /   397
    add_rms_norm    bf16      27.3 / 44.0   1216 /   692   compiled
    layer_norm      fp32       6.2 / 39.1    149 /  2378
    layer_norm      bf16       4.1 / 20.9    205 /   838
    add_layer_norm  fp32       5.1 / 25.4   1094 /  3961
    add_layer_norm  bf16       5.9 / 24.3   1108 /  1644
    rotary          fp32       9.7 / 22.0   1160 /   925   compiled
    rotary          bf16      10.6 / 22.1   1127 /   151   compiled
    bias_gelu       fp32      24.0 / 40.3  11145 / 12928
    bias_gelu       bf16      28.2 / 40.9   8513 /  7324
    silu_mul        fp32      10.0 / 32.4   2389 /  1884
    silu_mul        bf16      10.3 / 24.5   2437 /  1846   compiled

Compiled loses every decode shape: its overhead exceeds the whole plain op. So the
compiled implementation is registered with min_numel=COMPILE_MIN_NUMEL (smaller inputs run
plain), and on CPU it is claimed (so tested) and preferred only for the keys marked above
(see _COMPILED_PAYS): the ones that won at prefill in every run of the benchmark (this one,
two earlier and noisier ones that took medians, and one later run of the close calls:
silu_mul bf16 won by 1.15-1.3x each time); the others lost in at least one run. The bf16 norms win big because the plain
path makes several passes with dtype conversions that inductor fuses into one; ATen's
layer_norm is one fused kernel already. On CUDA the compiled version is registered for
fp32/bf16/fp16 without a measurement here (no GPU was available): fusing a norm's or
activation's 3-6 memory-bound kernels into one is the case inductor is built for, and
`benchmarks/inference_kernels.py --device cuda` measures it where a GPU is.

Note [fused_qkv's packed weight]
Three projections of the same input as one matmul read x once and launch one kernel
instead of three. The packed weight (q, k and v's weights concatenated, Conv1D's
transposed) is built on the first call and kept per q module, checked on each call
against the identity, version counter, storage, dtype and device of the six tensors it
came from, so loading, `.to()` or an in-place update of a weight rebuilds it. It costs one
extra copy of the three weights. Modules that are not plain `nn.Linear` / HF `Conv1D`
(quantized or tensor-parallel layers with forwards of their own) or whose weights are
tensor subclasses (torchao's quantized tensors, DTensor), modules with forward
hooks (ZeRO-Inference gathers weights in a pre-hook), and calls that autograd must record
(the packed copy is detached) run the three modules as they are.
On this CPU the matmul is bound by reading the weights, which packing does not change:
measured (`benchmarks/inference_kernels.py --ops fused_qkv --repeats 40`) plain / packed 227 / 253 us fp32 and 132 / 113 us bf16 at
decode, 26.4 / 26.5 ms and 7.9 / 8.4 ms at prefill: no gain worth a copy of the weights, so
on CPU it runs only when asked for (`use("packed")`). It is preferred on CUDA, where
decode is bound by kernel launches (unmeasured here: no GPU).
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

log = logging.getLogger("meshspeed")

Supports = Callable[[str, torch.dtype], bool]
Key = tuple[str, str, torch.dtype]  # (op, device type, dtype)


# ---- the plain paths (the reference of every op) -------------------------------------

def _plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32 at least; fp64 stays
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _plain_add_rms_norm(x, residual, weight, eps):
    s = x + residual
    return _plain_rms_norm(s, weight, eps), s


def _plain_layer_norm(x, weight, bias, eps):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def _plain_add_layer_norm(x, residual, weight, bias, eps):
    s = x + residual
    return _plain_layer_norm(s, weight, bias, eps), s


def _plain_rotary(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _plain_bias_gelu(x, bias, approximate="tanh"):
    return F.gelu(x if bias is None else x + bias, approximate=approximate)


def _plain_silu_mul(gate, up):
    return F.silu(gate) * up


def _plain_fused_qkv(x, q, k, v):
    return q(x), k(x), v(x)


_PLAIN: dict[str, Callable] = {
    "rms_norm": _plain_rms_norm,
    "add_rms_norm": _plain_add_rms_norm,
    "layer_norm": _plain_layer_norm,
    "add_layer_norm": _plain_add_layer_norm,
    "rotary": _plain_rotary,
    "bias_gelu": _plain_bias_gelu,
    "silu_mul": _plain_silu_mul,
    "fused_qkv": _plain_fused_qkv,
}
OPS: tuple[str, ...] = tuple(_PLAIN)


# ---- the registry ---------------------------------------------------------------------

@dataclass(frozen=True)
class Impl:
    """One implementation of an op: `fn` has the op's signature; `supports(device_type,
    dtype)` says where it runs correctly, `prefer` where "auto" should pick it (where it
    measured faster; by default wherever supported); higher `priority` is tried first.
    Inputs whose first tensor has fewer than `min_numel` elements run the plain path (too
    small to repay the implementation's own overhead)."""

    label: str
    fn: Callable
    supports: Supports
    priority: int
    prefer: Supports
    min_numel: int = 0


def _anywhere(device_type: str, dtype: torch.dtype) -> bool:
    return True


_PLAIN_IMPLS = {op: Impl("plain", fn, _anywhere, -(2**31), _anywhere) for op, fn in _PLAIN.items()}
_FAST: dict[str, list[Impl]] = {op: [] for op in OPS}
_chosen: dict[Key, Impl] = {}
_proven: set[tuple[str, Key]] = set()  # (label, key) whose first call succeeded
_failed: set[tuple[str, Key]] = set()  # (label, key) whose first call raised
_mode = os.environ.get("MESHSPEED_KERNELS", "auto").strip() or "auto"


def register(name: str, impl: Callable, supports: Supports, priority: int = 0, *,
             label: str | None = None, prefer: Supports | None = None,
             min_numel: int = 0) -> None:
    """Add `impl` as an implementation of op `name`, tried before lower priorities where
    `supports(device_type, dtype)` holds (and `prefer`, if given: where it pays; use(label)
    runs it wherever supported), for inputs of at least `min_numel` elements. `label`
    (default: impl's __name__) names it in describe() and use(); registering a label again
    replaces that implementation."""
    if name not in _PLAIN:
        raise ValueError(f"kernels.register: {name!r} is not an op; the ops are {', '.join(OPS)}")
    label = label or getattr(impl, "__name__", None)
    if not label or label in ("plain", "auto"):
        raise ValueError(f"kernels.register: label {label!r} for {name} is empty or reserved; "
                         "pass label= with a name other than 'plain' and 'auto'")
    impls = [i for i in _FAST[name] if i.label != label] + [
        Impl(label, impl, supports, priority, prefer or supports, min_numel)]
    _FAST[name] = sorted(impls, key=lambda i: -i.priority)
    _forget((name, label))


def _forget(op_label: tuple[str, str] | None = None) -> None:
    """Drop the cached picks (and, for an (op, label), what its first calls proved)."""
    _chosen.clear()
    if op_label is not None:
        label, op = op_label[1], op_label[0]
        _proven.difference_update({p for p in _proven if p[0] == label and p[1][0] == op})
        _failed.difference_update({f for f in _failed if f[0] == label and f[1][0] == op})


def _labels() -> set[str]:
    return {i.label for impls in _FAST.values() for i in impls}


def _choose(key: Key) -> Impl:
    op, device_type, dtype = key
    if _mode == "plain":
        return _PLAIN_IMPLS[op]
    if _mode != "auto" and _mode not in _labels():
        raise ValueError(f"kernels mode {_mode!r} (from use() or MESHSPEED_KERNELS) names no "
                         f"implementation; use 'auto', 'plain' or one of {sorted(_labels())}")
    for impl in _FAST[op]:
        if _mode not in ("auto", impl.label) or (impl.label, key) in _failed:
            continue
        if impl.supports(device_type, dtype) and (
                _mode == impl.label or impl.prefer(device_type, dtype)):
            return impl
    return _PLAIN_IMPLS[op]


def _call(op: str, x: torch.Tensor, *args):
    key = (op, x.device.type, x.dtype)
    impl = _chosen.get(key)
    if impl is None:
        impl = _chosen[key] = _choose(key)
    if impl.label == "plain" or x.numel() < impl.min_numel:
        return _PLAIN[op](x, *args)
    if (impl.label, key) in _proven:
        return impl.fn(x, *args)
    return _first_call(impl, key, x, *args)


def _first_call(impl: Impl, key: Key, *args):
    """Try `impl`'s first call on `key`; on failure fall back (Note [which implementation runs])."""
    try:
        out = impl.fn(*args)
    except Exception as err:  # noqa: BLE001 - any failure of a faster path means "not here"
        fast_err = err
    else:
        _proven.add((impl.label, key))
        return out
    _failed.add((impl.label, key))
    _chosen.pop(key, None)
    try:
        out = _PLAIN[key[0]](*args)
    except Exception:
        _failed.discard((impl.label, key))  # the input's fault: plain's error is the answer
        raise
    if _rank_zero():
        log.warning("kernels: %s's %r implementation failed on its first call on %s %s "
                    "(%s: %s); the plain PyTorch path runs there from now on", key[0],
                    impl.label, key[1], key[2], type(fast_err).__name__,
                    str(fast_err).splitlines()[0] if str(fast_err) else "")
    return out


def _rank_zero() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class _Mode:
    """Returned by use(): the mode is set already; `with` restores the previous one."""

    def __init__(self, previous: str):
        self.previous = previous

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        _set_mode(self.previous)


def _set_mode(mode: str) -> None:
    global _mode
    _mode = mode
    _forget()


def use(mode: str) -> _Mode:
    """Choose implementations from now on: "auto" (the best supported, the default), "plain"
    (the reference only: parity tests, debugging) or a label (that implementation where
    supported, plain elsewhere). Usable as `with kernels.use("plain"): ...` to restore."""
    if mode not in ("auto", "plain") and mode not in _labels():
        raise ValueError(f"kernels.use: {mode!r} names no implementation; use 'auto', 'plain' "
                         f"or one of {sorted(_labels())}")
    previous = _mode
    _set_mode(mode)
    return _Mode(previous)


def describe(*keys: tuple[str, torch.dtype]) -> dict[str, dict[str, str]]:
    """{op: {"device/dtype": label}}: which implementation each op uses (or would use, if its
    first call there succeeds) for the given (device_type, dtype) keys; by default every
    key dispatched so far plus CPU (and CUDA if present) in fp32 and bf16."""
    wanted = list(keys) or _default_keys()
    table: dict[str, dict[str, str]] = {}
    for op in OPS:
        row = table[op] = {}
        for device_type, dtype in wanted:
            key = (op, device_type, dtype)
            row[f"{device_type}/{dtype}"] = (_chosen.get(key) or _choose(key)).label
    return table


def _default_keys() -> list[tuple[str, torch.dtype]]:
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    keys = [(d, t) for d in devices for t in (torch.float32, torch.bfloat16)]
    keys += [(d, t) for _, d, t in _chosen if (d, t) not in keys]
    return keys


# ---- the public ops -------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps), computed in fp32 (fp64 for fp64), returned in
    x's dtype."""
    return _call("rms_norm", x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual add fused with the norm."""
    return _call("add_rms_norm", x, residual, weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dimension."""
    return _call("layer_norm", x, weight, bias, eps)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(x + residual), x + residual)."""
    return _call("add_layer_norm", x, residual, weight, bias, eps)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding (Llama/HF convention): x (..., T, D), cos/sin (..., T, D)."""
    return _call("rotary", x, cos, sin)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None, approximate: str = "tanh") -> torch.Tensor:
    """gelu(x + bias) (bias None: gelu(x))."""
    return _call("bias_gelu", x, bias, approximate)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(gate) * up."""
    return _call("silu_mul", gate, up)


def fused_qkv(x: torch.Tensor, q: torch.nn.Module, k: torch.nn.Module,
              v: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q(x), k(x), v(x)), as one matmul where all three are plain linears (Note
    [fused_qkv's packed weight]); the outputs may be views of one tensor."""
    return _call("fused_qkv", x, q, k, v)


# ---- fused_qkv's packed implementation -------------------------------------------------

def _is_conv1d(m: torch.nn.Module) -> bool:
    # HF's GPT-2 Conv1D (y = x @ W + b, W (in, out)), recognised without importing transformers.
    return type(m).__name__ == "Conv1D" and type(m).__module__ == "transformers.pytorch_utils"


def _packable(x: torch.Tensor, m: torch.nn.Module) -> bool:
    if type(m) is not torch.nn.Linear and not _is_conv1d(m):
        return False
    if m._forward_hooks or m._forward_pre_hooks:
        return False
    w, b = m.weight, m.bias
    if any(t is not None and type(t) not in (torch.nn.Parameter, torch.Tensor) for t in (w, b)):
        return False  # a tensor subclass (quantized, DTensor) brings its own matmul
    in_dim = w.shape[1] if type(m) is torch.nn.Linear else w.shape[0]
    same = all(t.device == x.device and t.dtype == x.dtype for t in (w, b) if t is not None)
    return w.dim() == 2 and in_dim == x.shape[-1] and same


def _stamp(t: torch.Tensor | None):
    if t is None:
        return None
    version = -1 if t.is_inference() else t._version
    return (t.data_ptr(), version, t.dtype, t.device, t.shape)


@dataclass
class _Packed:
    refs: tuple  # weakrefs to k, v and the six source tensors
    stamps: tuple
    weight: torch.Tensor  # (q_out + k_out + v_out, in)
    bias: torch.Tensor | None
    sizes: tuple[int, int, int]


_packs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _sources(m: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    return m.weight, m.bias


def _pack_for(q, k, v) -> _Packed:
    tensors = [t for m in (q, k, v) for t in _sources(m)]
    stamps = tuple(_stamp(t) for t in tensors)
    pack = _packs.get(q)
    if pack is not None and pack.stamps == stamps:
        live = [r() if r is not None else None for r in pack.refs]
        if live[0] is k and live[1] is v and all(a is b for a, b in zip(live[2:], tensors)):
            return pack
    with torch.inference_mode(False), torch.no_grad():
        weights = [m.weight.t() if _is_conv1d(m) else m.weight for m in (q, k, v)]
        sizes = tuple(w.shape[0] for w in weights)
        weight = torch.cat(weights, dim=0).contiguous()
        if all(m.bias is None for m in (q, k, v)):
            bias = None
        else:
            bias = torch.cat([m.bias if m.bias is not None else weight.new_zeros(n)
                              for m, n in zip((q, k, v), sizes)])
    refs = (weakref.ref(k), weakref.ref(v)) + tuple(
        weakref.ref(t) if t is not None else None for t in tensors)
    pack = _packs[q] = _Packed(refs, stamps, weight, bias, sizes)
    return pack


def _qkv_packed(x, q, k, v):
    """One matmul over the packed weight; the three modules where packing does not apply."""
    if not all(_packable(x, m) for m in (q, k, v)):
        return q(x), k(x), v(x)
    if torch.is_grad_enabled() and (x.requires_grad or any(
            p.requires_grad for m in (q, k, v) for p in _sources(m) if p is not None)):
        return q(x), k(x), v(x)  # the packed copy is detached: let autograd see the modules
    pack = _pack_for(q, k, v)
    return F.linear(x, pack.weight, pack.bias).split(pack.sizes, dim=-1)


# ---- torch.compile'd implementations ---------------------------------------------------

# Below this many elements in the first argument a compiled op loses to its own guards and
# dispatch (every decode shape measured), so the plain path runs (Note [where torch.compile
# pays]): 4096 (decode, 8 x 512) is below it, 524288 (prefill, 8 x 128 x 512) above.
COMPILE_MIN_NUMEL = 1 << 16


def _compiled(fn: Callable, label: str = "compiled") -> Callable:
    """`fn` under torch.compile, compiled lazily on its first call (importing dynamo and
    compiling are costs only a caller that uses it should pay)."""
    compiled = None

    def run(*args):
        nonlocal compiled
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True)
        return compiled(*args)

    run.__name__ = label
    return run


# Where torch.compile measured faster on this CPU at the prefill shape (decode shapes run
# plain, below COMPILE_MIN_NUMEL): Note [where torch.compile pays]; CUDA is assumed there.
_COMPILED_PAYS: dict[str, set[torch.dtype]] = {op: set() for op in OPS if op != "fused_qkv"}
_COMPILED_PAYS.update(rms_norm={torch.bfloat16}, add_rms_norm={torch.bfloat16},
                      rotary={torch.float32, torch.bfloat16}, silu_mul={torch.bfloat16})
_CUDA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _compiled_supports(op: str) -> Supports:
    # On CPU it is claimed (and so tested) only where it is also preferred: compiling every
    # op in the tests costs minutes on this machine.
    def supports(device_type: str, dtype: torch.dtype) -> bool:
        if device_type == "cuda":
            return dtype in _CUDA_DTYPES
        return device_type == "cpu" and dtype in _COMPILED_PAYS[op]
    return supports


for _op in _COMPILED_PAYS:
    register(_op, _compiled(_PLAIN[_op]), _compiled_supports(_op), priority=10,
             label="compiled", min_numel=COMPILE_MIN_NUMEL)
register("fused_qkv", _qkv_packed, _anywhere, priority=10, label="packed",
         prefer=lambda device_type, dtype: device_type == "cuda")
