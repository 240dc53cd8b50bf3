"""The backward split into its input half and its weight half (ZB-H1's "I" and "W").

    deferred = DeferredWeights()
    with deferred.capture():
        y = chunk(x)                 # every F.linear here runs through _SplitLinear
    y.backward(dy)                   # "I": x.grad, biases, every non-Linear parameter
    ...
    deferred.apply()                 # "W": each Linear weight's .grad, through autograd

Note [split at the op level]
"I" must not do "W"'s work and "W" must not redo "I"'s: the point of the split is that the
weight half is a separate, later slice of the same GEMMs. So, during the forward of a
micro-batch whose backward is split, a TorchFunctionMode sends every `F.linear` (what
nn.Linear calls) whose weight is a leaf that requires grad through `_SplitLinear`, an
autograd function whose backward computes the input gradient `dy @ W` and the bias
gradient, and queues (x, dy) for the weight, to which it has no edge (Note [no edge to a
deferred weight]). `apply` later computes each weight's `dy^T @ x`, the one GEMM the
ordinary backward would have done for it, so I + W does the GEMMs of one ordinary
backward, no more (tests/parallel/pipeline/test_weight_grad.py).
Parameters used by other ops (norms, embeddings, convolutions) get their gradients in I,
as in an ordinary backward.

Note [weight gradients arrive through autograd]
Data parallelism and ZeRO count gradients with `register_post_accumulate_grad_hook`,
which fires when autograd accumulates into `.grad`. So `apply` does not write `.grad`
itself: it runs one autograd backward over `_WeightGrad` nodes, one per weight, whose
backward returns that weight's gradient, and autograd's own accumulation (and its hooks)
does the rest. A weight used by several F.linear calls in one micro-batch (a layer
applied twice) gets one node summing all its uses, so its hook fires once per
micro-batch, as in an ordinary backward. A weight used both by F.linear and by another op
(an embedding tied to the output projection) gets two accumulations, one in I and one in
W; its hooks fire twice.

Note [no edge to a deferred weight]
Returning None for a weight from a backward is not enough: autograd still runs the
weight's accumulation node, with no gradient, and that fires its post-accumulate hooks.
So `_SplitLinear` gets the weight detached (the parameter itself travels as a slot
number) and the I graph has no edge to it at all. When neither the input nor the bias
requires grad (a first layer), a 0-dim anchor leaf that does keeps the output in the
graph, so that its backward still runs and queues the weight's share.

The mode costs a Python call per torch function in the captured forward; the GEMMs run
in the dtype of the incoming gradient, as autocast's backward would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class DeferredWeights:
    """The weight-gradient work one micro-batch's input-gradient pass leaves for later."""

    def __init__(self) -> None:
        self._weights: list[torch.Tensor] = []  # slot -> the parameter
        self._slots: dict[int, int] = {}  # id(parameter) -> slot
        self._uses: dict[int, list[torch.Tensor]] = {}  # slot -> x, dy, x, dy, ... of its uses

    def __len__(self) -> int:
        """How many weights wait for their gradient."""
        return len(self._uses)

    @contextlib.contextmanager
    def capture(self) -> Iterator[DeferredWeights]:
        """Run a forward under this: its F.linear weights' gradients wait for `apply`."""
        with _SplitLinearMode(self):
            yield self

    def slot(self, weight: torch.Tensor) -> int:
        """The number under which `weight`'s uses are queued (one per parameter)."""
        if id(weight) not in self._slots:
            self._slots[id(weight)] = len(self._weights)
            self._weights.append(weight)
        return self._slots[id(weight)]

    def add(self, slot: int, x: torch.Tensor, dy: torch.Tensor) -> None:
        self._uses.setdefault(slot, []).extend((x, dy))

    def apply(self) -> None:
        """Compute every queued weight gradient and accumulate it into `.grad` through
        autograd (Note [weight gradients arrive through autograd])."""
        uses, self._uses = self._uses, {}
        roots = [_WeightGrad.apply(self._weights[slot], *tensors) for slot, tensors in uses.items()]
        if roots:
            torch.autograd.backward(roots)


def _linear_args(args: tuple, kwargs: dict) -> tuple:
    names = ("input", "weight", "bias")
    values = list(args) + [kwargs.get(n) for n in names[len(args):]]
    return tuple(values[:3]) if len(values) >= 3 else (*values, None)


class _SplitLinearMode(TorchFunctionMode):
    """Sends F.linear through _SplitLinear (Note [split at the op level])."""

    def __init__(self, deferred: DeferredWeights) -> None:
        super().__init__()
        self.deferred = deferred

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            x, weight, bias = _linear_args(args, kwargs)
            if isinstance(weight, torch.Tensor) and weight.is_leaf and weight.requires_grad:
                # Note [no edge to a deferred weight]
                needs_anchor = not (x.requires_grad or bias is not None and bias.requires_grad)
                anchor = torch.zeros((), device=weight.device, requires_grad=True) if needs_anchor else None
                return _SplitLinear.apply(x, weight.detach(), bias, anchor, self.deferred.slot(weight),
                                          self.deferred)
        return func(*args, **kwargs)


class _SplitLinear(torch.autograd.Function):
    """y = x W^T + b; backward gives x and b their gradients now and queues W's. `weight`
    arrives detached (Note [no edge to a deferred weight]); `slot` names the parameter."""

    @staticmethod
    def forward(ctx, x, weight, bias, anchor, slot, deferred):
        ctx.save_for_backward(x, weight)
        ctx.deferred, ctx.slot, ctx.has_bias = deferred, slot, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy @ weight.to(dy.dtype) if ctx.needs_input_grad[0] else None
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        ctx.deferred.add(ctx.slot, x.detach(), dy.detach())
        return dx, None, db, None, None, None


class _WeightGrad(torch.autograd.Function):
    """A 0-dim node whose backward is `weight`'s gradient: the sum of dy^T x over its uses."""

    @staticmethod
    def forward(ctx, weight, *uses):
        ctx.save_for_backward(*uses)
        ctx.dtype = weight.dtype
        return weight.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        uses = ctx.saved_tensors
        grad = None
        for x, dy in zip(uses[::2], uses[1::2]):
            dy2 = dy.reshape(-1, dy.shape[-1])
            part = dy2.t() @ x.reshape(-1, x.shape[-1]).to(dy2.dtype)
            grad = part if grad is None else grad.add_(part)
        return (grad.to(ctx.dtype), *([None] * len(uses)))
