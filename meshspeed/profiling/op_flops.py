"""FLOPs and MACs of single aten ops, read from their argument shapes.

Note [what counts as a FLOP]: only matrix products are counted (mm, addmm, bmm, baddbmm,
convolution and scaled-dot-product attention, forward and backward). One multiply-add
(MAC) is 2 FLOPs. Element-wise ops (norms, activations, softmax, residual adds) are left
out: in a transformer they are well under 1% of the FLOPs and they are memory-bound, so
counting them would make "FLOPs" a worse predictor of step time, not a better one. This
is the convention of the 6·N·T rule (Kaplan et al. 2020, arXiv:2001.08361, section 2.1)
and of PaLM's model FLOPs utilisation (arXiv:2204.02311, appendix B).

Attention: QKᵀ and PV are 2·B·H·Tq·Tk·hd MACs together, so 4·B·Tq·Tk·(H·hd) FLOPs,
whether or not the mask is causal (a causal kernel may skip half of it; the count does
not, so that the number does not depend on which kernel ran). Its backward is counted as
twice the forward (dQ, dK, dV and dP: four products), as for a linear layer.

Ops are recognised by their overload packet (`aten.mm`), so every overload counts. An op
not listed here counts 0.
"""

from __future__ import annotations

from collections.abc import Callable
from math import prod

import torch

aten = torch.ops.aten


def _shape(x) -> tuple[int, ...]:
    return tuple(x.shape)


def _mm(args, kwargs, out) -> int:
    (m, k), n = _shape(args[0]), _shape(args[1])[-1]
    return m * k * n


def _addmm(args, kwargs, out) -> int:  # bias + a @ b
    (m, k), n = _shape(args[1]), _shape(args[2])[-1]
    return m * k * n


def _bmm(args, kwargs, out) -> int:
    (b, m, k), n = _shape(args[0]), _shape(args[1])[-1]
    return b * m * k * n


def _baddbmm(args, kwargs, out) -> int:
    (b, m, k), n = _shape(args[1]), _shape(args[2])[-1]
    return b * m * k * n


def _conv_macs(x_shape, w_shape, out_shape, transposed: bool) -> int:
    # each output element is a dot product over (in_channels / groups) * kernel elements;
    # a transposed convolution is the gradient of a plain one: count over its input instead
    per_output = prod(w_shape[1:])  # in/groups * kernel (out/groups * kernel if transposed)
    if transposed:
        return prod(x_shape) * per_output
    return prod(out_shape) * per_output


def _convolution(args, kwargs, out) -> int:
    transposed = bool(args[6]) if len(args) > 6 else bool(kwargs.get("transposed", False))
    return _conv_macs(_shape(args[0]), _shape(args[1]), _shape(out), transposed)


def _conv_backward(args, kwargs, out) -> int:
    # convolution_backward(grad_out, input, weight, bias_sizes, stride, padding, dilation,
    # transposed, output_padding, groups, output_mask): each of the input and weight
    # gradients asked for costs one forward's worth of MACs
    grad_out, x, w = args[0], args[1], args[2]
    transposed = bool(args[7])
    mask = args[-1]
    one = _conv_macs(_shape(x), _shape(w), _shape(grad_out), transposed)
    return one * (int(bool(mask[0])) + int(bool(mask[1])))


def _sdpa_macs(q, k) -> int:
    *batch, tq, hd = _shape(q)
    tk = _shape(k)[-2]
    return 2 * prod(batch) * tq * tk * hd  # QKᵀ and PV


def _sdpa(args, kwargs, out) -> int:
    return _sdpa_macs(args[0], args[1])


def _sdpa_backward(args, kwargs, out) -> int:
    # the backward ops take (grad_out, q, k, v, ...): twice the forward (Note above)
    return 2 * _sdpa_macs(args[1], args[2])


def _op_table() -> dict:
    table: dict = {
        aten.mm: _mm,
        aten.addmm: _addmm,
        aten.bmm: _bmm,
        aten.baddbmm: _baddbmm,
        aten.convolution: _convolution,
        aten.convolution_backward: _conv_backward,
    }
    # the attention kernels present in this torch build (names vary across versions); the
    # math fallback is not listed: it decomposes into bmm calls, which are counted
    for name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"):
        if hasattr(aten, name):
            table[getattr(aten, name)] = _sdpa
        if hasattr(aten, name + "_backward"):
            table[getattr(aten, name + "_backward")] = _sdpa_backward
    return table


MACS_OF: dict[object, Callable] = _op_table()


def op_macs(func, args, kwargs, out) -> int:
    """Multiply-adds of one call of the aten op `func` (an OpOverload); 0 if not counted."""
    rule = MACS_OF.get(func.overloadpacket)
    return 0 if rule is None else int(rule(args, kwargs or {}, out))
