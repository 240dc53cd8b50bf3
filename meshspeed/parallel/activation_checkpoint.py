"""Activation checkpointing: keep a block's inputs, recompute the block in backward.

`checkpoint(function, *args)` runs `function(*args)` without recording its graph, keeps
only the tensor arguments (whole, or each tp rank's slice of them with
`partition_activations`; in host memory with `cpu_checkpointing`), and in backward runs
`function` again from them, with the random-number generators as they were in forward,
to get the gradients. It is DeepSpeed's `deepspeed.checkpointing.checkpoint`; the
settings come from `configure()` (meshspeed/parallel/activation_setup.py) and reach this
module as one frozen `CheckpointPolicy`.

Note [a custom autograd.Function, not torch.utils.checkpoint]
torch's non-reentrant checkpoint keeps the block's arguments alive by reference until
backward: nothing would be left to slice across tp ranks or move to host memory. Here
the kept inputs are exactly what `ctx.save_for_backward` receives, which also makes
them visible to saved-tensor hooks (`saved_activation_bytes` measures through them).
The Function is reentrant: backward recomputes and calls `torch.autograd.backward` on
the recomputed outputs, so gradients reach parameters inside `function` by
accumulation, and `torch.autograd.grad` through a checkpoint is refused with an error
(as in torch's reentrant mode and DeepSpeed). The reentrant mode's other pitfall, no
gradients for the parameters when no argument requires grad, is closed by Note [an
argument that requires grad].

Note [an argument that requires grad]
A Function's backward runs only if one of its inputs requires grad. The first block of a
model often gets a plain tensor (token embeddings of a frozen table, raw features), and
then the block's parameters would silently get no gradient. When grad mode is on and no
tensor argument requires grad, an empty tensor that does is passed along; its gradient
is None. The cost: the outputs then require grad even if `function` has no trainable
parameters, and backward recomputes it for nothing.

Note [RNG state at the recompute]
Forward records the host generator's state, CUDA's (when CUDA is available) and the
tracker's named states (meshspeed/parallel/rng_tracker.py); the recompute starts from
those and the states of the moment are put back afterwards. So dropout, inside or
outside `get_cuda_rng_tracker().fork()`, draws the same masks in both runs, and code
after backward sees the generators as if no recompute had happened. Autocast is
recorded the same way: a block run under `torch.autocast` in forward is recomputed under
it, so the recompute makes the same dtypes (backward runs outside autocast otherwise).

Note [what partition_activations slices]
Every floating-point tensor argument, flattened and zero-padded to a multiple of the tp
size; rank r keeps elements [r*chunk, (r+1)*chunk) in a storage of its own, and backward
all-gathers the pieces over the tp group before the recompute. This assumes what
Megatron's layout gives: each such argument is equal on every rank of the tp group (the
hidden states between tensor-parallel blocks without sequence parallelism). An argument
that differs per tp rank, a sequence-parallel shard, would be rebuilt from other ranks'
pieces: partition only replicated inputs. Integer tensors (token ids, masks) are kept
whole. Nothing is checked per call: a check would cost a collective in every forward.
Unlike DeepSpeed, the caller's tensor is not emptied in place (`arg.data = empty`): its
memory goes when the caller drops it, as `h = checkpoint(block, h)` does.

Note [cpu_checkpointing]
A kept input on an accelerator is copied to host memory in forward (a blocking copy)
and back to its device in backward. Inputs in host memory already, everything on a
CPU-only machine, are kept as they are: there the move is no copy at all, and the
device-to-host path runs only on a machine with an accelerator.

Note [non_reentrant_checkpoint]
DeepSpeed's second entry point, for blocks that need `torch.autograd.grad` through them
or whose parameters must get gradients without a Function in between. It is torch's
non-reentrant checkpoint (`torch.utils.checkpoint.checkpoint(use_reentrant=False)`):
saved tensors are dropped in forward and recomputed when backward first unpacks one, and
the outputs are exactly what `function` returns (non-tensors, lists and `requires_grad`
as without checkpointing). torch records the host and device generators and autocast;
the `context_fn` adds the tracker's named states (Note [RNG state at the recompute]) and
the synchronize/profile boundaries. What it does not do is partition_activations or
cpu_checkpointing: torch's implementation holds the block's arguments by reference until
backward, so there is no copy to slice or move. With either setting on it is an error
(NonReentrantCheckpointError), not a silent full-size copy on the device: `checkpoint` (and
`"pipeline": {"use_reentrant": true}`) is the entry point that partitions and offloads.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint

from meshspeed import comm
from meshspeed.parallel import rng_tracker
from meshspeed.process.accelerator import get_accelerator

log = logging.getLogger("meshspeed")


class NonReentrantCheckpointError(ValueError):
    """The configured activation checkpointing needs the reentrant checkpoint."""


@dataclass(frozen=True)
class CheckpointPolicy:
    """What `checkpoint` does with the inputs it keeps. `group` is the tensor-parallel
    process group (None: no model parallelism); `rank`/`size` are this rank's place in it."""

    partition: bool = False  # keep 1/size of each floating-point input, gather in backward
    cpu: bool = False  # keep the inputs in host memory
    synchronize: bool = False  # accelerator synchronize at each forward/backward boundary
    profile: bool = False  # log forward and recompute times on rank 0
    group: Any = field(default=None, compare=False)
    rank: int = 0
    size: int = 1

    def partitions(self, t: torch.Tensor) -> bool:
        """Whether `t` is kept as a slice (Note [what partition_activations slices])."""
        return self.partition and self.size > 1 and t.is_floating_point() and t.numel() > 0

    def partitions_any(self) -> bool:
        """Whether any input would be kept as a slice."""
        return self.partition and self.size > 1


_current = [CheckpointPolicy()]  # set by activation_setup.configure(); one per process


def current_policy() -> CheckpointPolicy:
    return _current[0]


def set_policy(policy: CheckpointPolicy) -> None:
    _current[0] = policy


def checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)`, with its activations recomputed in backward instead of kept.

    Returns what `function` returns: a tensor, or a tuple/list of tensors and other values
    (returned as a tuple). Arguments may be tensors or anything else; only tensors are
    kept for backward, and tensors passed by keyword get gradients as positional ones do.
    Under `torch.no_grad()` this is a plain call."""
    return checkpoint_with(current_policy(), function, *args, **kwargs)


def checkpoint_with(policy: CheckpointPolicy, function: Callable, *args: Any, **kwargs: Any) -> Any:
    """`checkpoint` under an explicit policy rather than the configured one."""
    if not callable(function):
        raise TypeError(f"checkpoint(function, *args): function must be callable, got "
                        f"{type(function).__name__}; pass the block (module or function) first")
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    if kwargs:  # the Function takes positional inputs only: keywords ride at the end
        function, args = _Keywords(function, len(args), tuple(kwargs)), (*args, *kwargs.values())
    needs_anchor = not any(torch.is_tensor(a) and a.requires_grad for a in args)
    # Note [an argument that requires grad]
    anchor = torch.empty(0, requires_grad=True) if needs_anchor else None
    layout: list[Any] = []  # filled by forward: where the non-tensor outputs go
    tensors = _Recompute.apply(function, policy, layout, anchor, *args)
    return _merge(layout, tensors)


def non_reentrant_checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)` with its activations recomputed in backward, through
    torch's non-reentrant checkpoint (Note [non_reentrant_checkpoint]): returns exactly what
    `function` returns, and `torch.autograd.grad` works through it. Under `torch.no_grad()`
    this is a plain call."""
    if not callable(function):
        raise TypeError(f"non_reentrant_checkpoint(function, *args): function must be callable, got "
                        f"{type(function).__name__}; pass the block (module or function) first")
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    policy = current_policy()
    if policy.partitions_any() or policy.cpu:
        setting = "cpu_checkpointing" if policy.cpu else "partition_activations"
        raise NonReentrantCheckpointError(
            f"activation_checkpointing.{setting} needs the reentrant checkpoint, which keeps the inputs it "
            "slices or offloads: use deepspeed.checkpointing.checkpoint (a pipeline: \"pipeline\": "
            f"{{\"use_reentrant\": true}}) or turn {setting} off (Note [non_reentrant_checkpoint])")
    label = _label(function)
    with _boundary(policy, label, "forward"):
        return torch.utils.checkpoint.checkpoint(
            function, *args, use_reentrant=False, preserve_rng_state=True,
            context_fn=lambda: _recompute_contexts(policy, label), **kwargs)


def _recompute_contexts(policy: CheckpointPolicy, label: str) -> tuple[Any, Any]:
    """torch's context_fn: the forward context records the tracker's named states, the
    recompute context starts from them (and puts back the states of the moment after)."""
    tracker = rng_tracker.get_cuda_rng_tracker()
    recorded: dict[str, torch.Tensor] = {}

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        recorded.update(tracker.get_states())
        yield

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        now = tracker.get_states()
        tracker.set_states(recorded)
        try:
            with _boundary(policy, label, "recompute"):
                yield
        finally:
            tracker.set_states(now)

    return forward(), recompute()


class _Keywords:
    """`function` called with its last arguments by keyword, named as `function` is."""

    def __init__(self, function: Callable, positional: int, names: tuple[str, ...]) -> None:
        self.function, self.positional, self.names = function, positional, names
        self.__qualname__ = _label(function)

    def __call__(self, *args: Any) -> Any:
        keywords = dict(zip(self.names, args[self.positional:]))
        return self.function(*args[:self.positional], **keywords)


# -- forward's bookkeeping ------------------------------------------------------------------

_TENSOR = object()  # marks a tensor's position in an output layout


@dataclass(frozen=True)
class _Slot:
    """How to give back one argument: a value as it was, or saved tensor `index` (whole or
    this rank's slice of it) restored to `shape` on `device`."""

    value: Any = None
    index: int = -1
    sliced: bool = False
    shape: tuple[int, ...] = ()
    device: torch.device | None = None
    requires_grad: bool = False


def _keep(args: tuple, policy: CheckpointPolicy) -> tuple[list[_Slot], list[torch.Tensor]]:
    """What forward saves for each argument (Note [what partition_activations slices],
    Note [cpu_checkpointing])."""
    slots, kept = [], []
    for a in args:
        if not torch.is_tensor(a):
            slots.append(_Slot(value=a))
            continue
        sliced = policy.partitions(a)
        t = _my_slice(a.detach(), policy) if sliced else a
        if policy.cpu and t.device.type != "cpu":
            t = t.detach().to("cpu")
        slots.append(_Slot(index=len(kept), sliced=sliced, shape=tuple(a.shape), device=a.device,
                           requires_grad=a.requires_grad))
        kept.append(t)
    return slots, kept


def _my_slice(t: torch.Tensor, policy: CheckpointPolicy) -> torch.Tensor:
    """This rank's 1/size of `t` flattened and zero-padded to a multiple of size, in its own
    storage (a view would keep the whole tensor alive)."""
    flat = t.reshape(-1)
    chunk = -(-flat.numel() // policy.size)
    pad = chunk * policy.size - flat.numel()
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat[policy.rank * chunk:(policy.rank + 1) * chunk].clone()


def _give_back(slots: list[_Slot], kept: tuple[torch.Tensor, ...], policy: CheckpointPolicy) -> list[Any]:
    """The arguments for the recompute: tensors whole, on their devices, as fresh leaves."""
    out = []
    for s in slots:
        if s.index < 0:
            out.append(s.value)
            continue
        t = kept[s.index].to(s.device)
        if s.sliced:
            whole = t.new_empty(t.numel() * policy.size)
            comm.all_gather_into_tensor(whole, t.contiguous(), group=policy.group)
            t = whole[:math.prod(s.shape)].view(s.shape)
        out.append(t.detach().requires_grad_(s.requires_grad))
    return out


def _split_outputs(out: Any, label: str) -> tuple[list[Any], tuple[torch.Tensor, ...]]:
    if torch.is_tensor(out):
        return [_TENSOR], (out,)
    if isinstance(out, (tuple, list)):
        layout = [_TENSOR if torch.is_tensor(o) else o for o in out]
        return layout, tuple(o for o in out if torch.is_tensor(o))
    raise TypeError(f"checkpoint({label}): the function returned a {type(out).__name__}; it must "
                    "return a tensor or a tuple/list of tensors and other values")


def _merge(layout: list[Any], tensors: Any) -> Any:
    if layout == [_TENSOR]:
        return tensors
    tensors = iter((tensors,) if torch.is_tensor(tensors) else tensors)
    return tuple(next(tensors) if o is _TENSOR else o for o in layout)


def _label(function: Callable) -> str:
    return getattr(function, "__qualname__", None) or type(function).__name__


@contextlib.contextmanager
def _boundary(policy: CheckpointPolicy, label: str, phase: str) -> Iterator[None]:
    """Synchronize the accelerator around a phase, and time it, as the policy asks."""
    if not (policy.synchronize or policy.profile):
        yield
        return
    accelerator = get_accelerator()
    accelerator.synchronize()
    start = time.perf_counter()
    yield
    accelerator.synchronize()
    if policy.profile and (not comm.is_initialized() or comm.get_rank() == 0):
        log.info("activation checkpoint %s: %s %.3f ms", label, phase, (time.perf_counter() - start) * 1e3)


class _RngSnapshot:
    """The generators' states at one moment (Note [RNG state at the recompute])."""

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        self.named = rng_tracker.get_cuda_rng_tracker().get_states()

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)
        rng_tracker.get_cuda_rng_tracker().set_states(self.named)


def _autocast_now() -> list[tuple[str, torch.dtype]]:
    """The devices autocast is on for, with their dtypes."""
    return [(d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]


@contextlib.contextmanager
def _autocast_as(recorded: list[tuple[str, torch.dtype]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for device, dtype in recorded:
            stack.enter_context(torch.autocast(device, dtype=dtype))
        yield


class _Recompute(torch.autograd.Function):
    """Note [a custom autograd.Function, not torch.utils.checkpoint]."""

    @staticmethod
    def forward(ctx, function, policy, layout, anchor, *args):
        label = _label(function)
        with _boundary(policy, label, "forward"):
            ctx.rng, ctx.autocast = _RngSnapshot(), _autocast_now()
            ctx.function, ctx.policy, ctx.label = function, policy, label
            ctx.slots, kept = _keep(args, policy)
            out = function(*args)  # grad mode is off inside a Function's forward
            ctx.save_for_backward(*kept)
            shape, tensors = _split_outputs(out, label)
        layout.extend(shape)
        ctx.mark_non_differentiable(*(t for t in tensors if not t.is_floating_point()))
        return tensors[0] if shape == [_TENSOR] else tensors

    @staticmethod
    def backward(ctx, *grads):
        if not getattr(torch.autograd, "_is_checkpoint_valid", lambda: True)():
            raise RuntimeError("checkpoint(): gradients through an activation checkpoint are only "
                               "computed by .backward(); torch.autograd.grad() cannot reach them, "
                               "call loss.backward() and read .grad instead")
        with _boundary(ctx.policy, ctx.label, "recompute and backward"):
            inputs = _give_back(ctx.slots, ctx.saved_tensors, ctx.policy)
            now = _RngSnapshot()
            ctx.rng.restore()
            try:
                with torch.enable_grad(), _autocast_as(ctx.autocast):
                    out = ctx.function(*inputs)
            finally:
                now.restore()
            _, outs = _split_outputs(out, ctx.label)
            pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad and g is not None]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads_in = tuple(a.grad if torch.is_tensor(a) else None for a in inputs)
        return (None, None, None, None, *grads_in)
