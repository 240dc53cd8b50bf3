"""DeepSpeed's per-parameter access helpers (`deepspeed.utils.safe_get_full_fp32_param` ...),
for every strategy: stage 0 (data parallel) and ZeRO 1-3, fp32 or bf16/fp16 training.

What each reads, for a parameter of a model wrapped by `meshspeed.initialize`:
- fp32 param: the fp32 master weights the optimizer steps on (the parameter itself in
  fp32 training below stage 1);
- grad: the gradient this step will apply, reduced and averaged over the data-parallel
  ranks, in fp32; available from the backward of the last micro-step of an accumulation
  window (ZeRO 2-3: of any micro-step, accumulated so far) until `engine.step()`. Stage 0
  and ZeRO 1 after an earlier backward of the window (inside `engine.no_sync()`, or a
  micro-step before the boundary): this rank's own accumulated gradient, whole and
  unreduced (Note [local gradients before the reduction]). None before the window's
  first backward, after the step, and for a frozen parameter;
- optimizer state: `optimizer.state[master][key]` ("exp_avg", "exp_avg_sq" for Adam,
  "momentum_buffer" for SGD); None before the optimizer's first step.

`full` values are whole (the parameter's shape): each rank contributes its own range and
one all-reduce puts them together, so under ZeRO every rank of the data-parallel group
must call them together (as in DeepSpeed). `local` values are this rank's range of the
flattened parameter (1-D; the whole parameter at stage 0, and a gradient read before the
reduction), with no communication; stage 3's range is the one `param.ds_tensor` holds. Values returned are copies. The `set`
variants write the rank's range of the given full value (every rank passes the same
value) and let the parameters follow: a collective under ZeRO 1-3.

A parameter no strategy owns (no `meshspeed.initialize` yet) reads as None, as in
DeepSpeed; writing to one raises.
"""

from __future__ import annotations

import torch
from torch import nn

from meshspeed import comm
from meshspeed.parallel import registry
from meshspeed.parallel.protocol import Strategy, declares
from meshspeed.parallel.slices import ParamAccess

__all__ = [
    "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
]


def safe_get_full_fp32_param(param: nn.Parameter) -> torch.Tensor | None:
    access = _access(param)
    return None if access is None else _assemble(access, access.master)


def safe_get_local_fp32_param(param: nn.Parameter) -> torch.Tensor | None:
    access = _access(param)
    return None if access is None else access.master.float().clone()


@torch.no_grad()
def safe_set_full_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    access = _access(param, writing=True)
    access.master.copy_(_own_range(access, value))
    access.publish()


# Note [local gradients before the reduction]
# Stage 0 and ZeRO 1 reduce once per step, at the boundary backward; until then each rank
# holds the whole gradient of its own micro-batches. DeepSpeed's helpers return that
# `param.grad` there, and scripts read it inside `engine.no_sync()` (e.g. to compare two
# passes): so do these, without communicating (the ranks' values differ, and are not
# averaged). Stages 2-3 hold no such gradient: they read the shard reduced so far.
def safe_get_full_grad(param: nn.Parameter) -> torch.Tensor | None:
    access = _access(param)
    if access is None or access.grad is None:
        return None
    if access.local_grad:
        return access.grad.float().clone().view(access.shape)
    return _assemble(access, access.grad)


def safe_get_local_grad(param: nn.Parameter) -> torch.Tensor | None:
    access = _access(param)
    if access is None or access.grad is None:
        return None
    return access.grad.float().clone()


@torch.no_grad()
def safe_set_full_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    """Replace the gradient the next `engine.step()` applies (every rank passes the same
    whole value; read before the reduction, the rank's own whole gradient is replaced)."""
    access = _access(param, writing=True)
    grad = _writable_grad(access, "safe_set_full_grad")
    flat = _whole(access, value) if access.local_grad else _own_range(access, value)
    grad.copy_(flat.to(grad.dtype))


@torch.no_grad()
def safe_set_local_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    """Replace this rank's range of the gradient (the shape `safe_get_local_grad` returns)."""
    access = _access(param, writing=True)
    grad = _writable_grad(access, "safe_set_local_grad")
    grad.copy_(_local(value, grad.numel(), "safe_set_local_grad").to(grad.dtype))


@torch.no_grad()
def safe_set_local_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    """Replace this rank's range of the fp32 masters; the parameters follow (every rank of
    the group calls it, as for the full setter)."""
    access = _access(param, writing=True)
    access.master.copy_(_local(value, access.end - access.start, "safe_set_local_fp32_param")
                        .to(access.master.dtype).view_as(access.master))
    access.publish()


@torch.no_grad()
def safe_set_local_optimizer_state(param: nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Replace this rank's range of an optimizer state tensor ("exp_avg", ...)."""
    _set_state(param, optim_state_key, "safe_set_local_optimizer_state",
               lambda access, state: _local(value, state.numel(), "safe_set_local_optimizer_state"), value)


def safe_get_full_optimizer_state(param: nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    access = _access(param)
    state = None if access is None else _state(param, access, optim_state_key)
    if state is None:
        return None
    if state.dim() == 0:  # a per-parameter scalar ("step"): the same on every rank
        return state.clone()
    return _assemble(access, state.reshape(-1))


def safe_get_local_optimizer_state(param: nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    access = _access(param)
    state = None if access is None else _state(param, access, optim_state_key)
    if state is None:
        return None
    return state.clone() if state.dim() == 0 else state.reshape(-1).float().clone()


@torch.no_grad()
def safe_set_full_optimizer_state(param: nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    _set_state(param, optim_state_key, "safe_set_full_optimizer_state",
               lambda access, state: _own_range(access, value), value)


def _set_state(param: nn.Parameter, key: str, caller: str, flat_of, value) -> None:
    """Write optimizer state `key` of the parameter's range: a scalar ("step") from `value`,
    a tensor from `flat_of(access, state)` (this rank's range, flat)."""
    access = _access(param, writing=True)
    optimizer, entry = _entry(param, access)
    if entry is None:
        raise ValueError(f"{caller}: the optimizer holds no state for this parameter "
                         f"yet ({key!r} is created by its first step)")
    state = _pick(entry, key)
    if state.dim() == 0:
        state.copy_(torch.as_tensor(value, dtype=state.dtype))
    else:
        state.copy_(flat_of(access, state).to(state.dtype).view_as(state))
    optimizer.state[access.key] = entry  # a store that hands out copies (swap files) keeps it


def _access(param: nn.Parameter, writing: bool = False) -> ParamAccess | None:
    owner = registry.owner_of(param)
    if not declares(owner, Strategy):  # none, or zero.Init's slices before initialize
        if writing:
            raise ValueError("this parameter belongs to no model wrapped by meshspeed.initialize: it has "
                             "no fp32 master weights or optimizer state to write")
        return None
    return owner.param_access(param)


def _assemble(access: ParamAccess, local: torch.Tensor) -> torch.Tensor:
    """The whole value (fp32, the parameter's shape) from each rank's range of it."""
    full = torch.zeros(access.shape.numel(), dtype=torch.float32, device=local.device)
    full[access.start : access.end] = local.reshape(-1)
    if access.sharded and comm.get_world_size(access.group) > 1:
        comm.all_reduce(full, group=access.group)  # ranges are disjoint: the sum is exact
    return full.view(access.shape)


def _own_range(access: ParamAccess, value: torch.Tensor) -> torch.Tensor:
    value = torch.as_tensor(value)
    if value.numel() != access.shape.numel():
        raise ValueError(f"expected a value of shape {tuple(access.shape)}, got {tuple(value.shape)}")
    return value.reshape(-1)[access.start : access.end].to(device=access.master.device, dtype=torch.float32)


def _whole(access: ParamAccess, value: torch.Tensor) -> torch.Tensor:
    value = torch.as_tensor(value)
    if value.numel() != access.shape.numel():
        raise ValueError(f"expected a value of shape {tuple(access.shape)}, got {tuple(value.shape)}")
    return value.reshape(-1)


def _local(value: torch.Tensor, numel: int, caller: str) -> torch.Tensor:
    value = torch.as_tensor(value).reshape(-1)
    if value.numel() != numel:
        raise ValueError(f"{caller}: this rank's range has {numel} elements, the value has {value.numel()} "
                         "(read the range's shape with the matching safe_get_local_* first)")
    return value


def _writable_grad(access: ParamAccess, caller: str) -> torch.Tensor:
    if access.grad is None:
        raise ValueError(f"{caller}: this parameter has no gradient now; write it after backward and "
                         "before engine.step() (a frozen parameter never has one)")
    if access.grad_is_copy:
        raise ValueError(f"{caller}: this parameter's gradient lives in an NVMe swap file at this point and "
                         "cannot be written in place; write it before the accumulation boundary's backward ends")
    return access.grad


def _state(param: nn.Parameter, access: ParamAccess, key: str) -> torch.Tensor | None:
    _, entry = _entry(param, access)
    return None if entry is None else _pick(entry, key)


def _entry(param: nn.Parameter, access: ParamAccess):
    """The optimizer and its state for the parameter's master (None before its first step)."""
    optimizer = registry.optimizer_of(param)
    if optimizer is None or access.key not in optimizer.state:
        return optimizer, None
    return optimizer, optimizer.state[access.key] or None


def _pick(entry: dict, key: str) -> torch.Tensor:
    if key not in entry:
        raise KeyError(f"optimizer state {key!r} not held for this parameter; it has {sorted(entry)}")
    value = entry[key]
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"optimizer state {key!r} is a {type(value).__name__}, not a tensor")
    return value
