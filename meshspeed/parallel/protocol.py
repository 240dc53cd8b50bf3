"""The contracts between the engine and what the axes hand it.

Note [one contract for every axis]
Each axis is applied by one function of the same shape, `apply_<axis>(model, mesh,
config, ...) -> what the engine needs` (docs/architecture.md lists them), called in a
fixed order by engine/build.py. What comes back is one of the protocols below, and the
engine calls those and nothing else: it never asks an object what it is (no getattr /
hasattr, no concrete class names), and the composition rules live in one table
(meshspeed/config/composition.py).

- `Strategy`: the sharding axis (stage 0 data parallelism, ZeRO 1-3, with offload
  injected as a placement). Every run has exactly one.
- `StepPart`: what another axis adds to the optimizer step: work on the gradients before
  it (tensor parallelism sums the partial gradients of sequence-parallel norms; pipeline
  parallelism sums tied layers over stages) and the ranks the norm is taken over.
- `ForwardPart`: what an axis does around the model's forward (context parallelism cuts
  each batch and weighs the loss).
- `StepCallback`: something stepped after each applied optimizer step (compression's
  schedule).

Optional capabilities are small protocols a class declares by inheriting them, so
which strategy has what is written in its class line, and code that needs one asks
with `isinstance` against the protocol, never for a method by name:
`ParameterOwner` (gathers its parameters for a user's `gathered` block),
`ExternalParameters` (stage 3's registry of parameters used outside their module),
`RankState` (state each rank saves for itself in checkpoints), `LocalGradients`
(gradients left unreduced for an optimizer that communicates by itself: 1-bit Adam).

One step, as the engine calls a strategy:

    begin_micro_step(boundary, scale)  before forward of each micro-step
                                      (or hold_reductions(): accumulate only)
    (forward, loss.backward())
    finish_backward()                 after backward: reductions launched / settled
    prepare_step() -> StepGradients   at the boundary: masters carry their gradients
    (unscale, norm and clip through StepGradients, optimizer.step() on the masters)
    finish_step()                     masters -> parameters, gradients dropped
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from meshspeed.parallel.slices import OwnedSlice, ParamAccess
from meshspeed.parallel.step import NormScope, StepGradients

__all__ = ["Closeable", "ExternalParameters", "ForwardPart", "GatheredCache", "LocalGradients",
           "ParameterOwner", "RankState", "StepCallback", "StepPart", "Strategy", "declares"]


@runtime_checkable
class Strategy(Protocol):
    # parameter -> the fp32 tensor the optimizer steps on for it (the optimizer is built
    # from this map); keyed by parameter identity, valid while the strategy lives
    master_of: dict[int, nn.Parameter]

    # -- the step ------------------------------------------------------------------------------
    def begin_micro_step(self, boundary: bool, loss_scale: float = 1.0) -> None:
        """Before a micro-step's forward: whether its backward is the accumulation boundary
        (reduces), and the loss scale its backward runs under."""
        ...
    def hold_reductions(self) -> None:
        """The coming backward passes only accumulate `.grad`: nothing is reduced, even
        where every micro-step normally reduces (ZeRO 2-3), until `begin_micro_step(True)`
        and `finish_backward()` reduce all of it (pipelined passes that are not whole
        micro-steps: Note [micro-steps of a pipelined batch] in engine/pipeline.py)."""
        ...
    def finish_backward(self) -> None: ...
    def drop_unreduced(self) -> None:
        """Discard the gradients accumulated since the last step and not reduced yet
        (engine.zero_grad): stage 0 and ZeRO 1 before the boundary's reduction; nothing
        where reductions started, or where every micro-step reduces (ZeRO 2-3)."""
        ...
    def prepare_step(self) -> StepGradients: ...
    def finish_step(self) -> None: ...
    def masters(self) -> list[nn.Parameter]: ...

    # -- parameters ----------------------------------------------------------------------------
    @property
    def shards_params(self) -> bool: ...
    def flush(self) -> None:
        """Finish background work that changes parameters (delayed update) and publish it."""
        ...
    def param_access(self, param: nn.Parameter) -> ParamAccess:
        """One parameter's fp32 values, gradient and optimizer key on this rank
        (`meshspeed.utils.safe_get_full_fp32_param` and friends)."""
        ...

    # -- checkpoints ---------------------------------------------------------------------------
    def owned_slices(self) -> list[OwnedSlice]: ...
    def sync_params_from_masters(self) -> None: ...

    # -- accounting ----------------------------------------------------------------------------
    def memory_tensors(self) -> dict[str, list[torch.Tensor]]: ...
    def host_tensors(self) -> list[torch.Tensor]: ...
    def nvme_bytes(self) -> dict[str, int]: ...
    def peak_gathered_bytes(self) -> int: ...

    def close(self) -> None: ...


@runtime_checkable
class StepPart(Protocol):
    """An axis's share of the optimizer step (tensor and pipeline parallelism)."""

    def before_step(self, strategy: Strategy) -> None:
        """After `prepare_step`, before the norm: finish the gradients this axis owns."""
        ...

    def widen(self, scope: NormScope, strategy: Strategy) -> NormScope:
        """`scope` with this axis's ranks added (its groups, split mask or skipped copies)."""
        ...


@runtime_checkable
class ForwardPart(Protocol):
    """An axis's share of the forward (context parallelism)."""

    def run(self, module: nn.Module, inputs: tuple, kwargs: dict) -> Any: ...


@runtime_checkable
class StepCallback(Protocol):
    def step(self) -> None: ...


# -- capabilities a class declares by inheriting them ----------------------------------------------
@runtime_checkable
class ParameterOwner(Protocol):
    """Owns parameters in the registry (parallel/registry.py) and makes them whole for a
    user's block (parallel/gather.py)."""

    def gather_for_user(self, params: list[nn.Parameter]) -> Any: ...
    def publish_user_changes(self, params: list[nn.Parameter], src_rank: int) -> None: ...
    def release_for_user(self, token: Any) -> None: ...


@runtime_checkable
class ExternalParameters(Protocol):
    def check_external(self, module: nn.Module, param: nn.Parameter) -> None:
        """A use of `param` by `module` registered after the strategy was built: accept it
        or raise saying why it needs registering before initialize."""
        ...


@runtime_checkable
class RankState(Protocol):
    """State each rank saves in its own checkpoint file (Note [rank-local state] in
    checkpoint/load.py)."""

    def rank_state(self) -> dict[str, torch.Tensor]: ...
    def load_rank_state(self, state: dict[str, torch.Tensor], steps: int) -> None: ...


@runtime_checkable
class GatheredCache(Protocol):
    """Keeps parameters gathered between passes that can be sharded again on request
    (stage 3's units: DeepSpeed's `engine.empty_partition_cache()`)."""

    def release_gathered(self) -> None: ...


@runtime_checkable
class HandsOver(Protocol):
    """Gives its parameters up to a later `initialize` on the same module: makes each whole
    again as a plain tensor (a collective), removes its hooks, and refuses further steps
    (Note [a second engine on one model] in engine/build.py)."""

    def hand_over(self) -> None: ...


@runtime_checkable
class Closeable(Protocol):
    """Holds files or threads to release at the end of training (an offloaded optimizer)."""

    def close(self) -> None: ...


@runtime_checkable
class LocalGradients(Protocol):
    """Can leave a step's gradients unreduced when `leave_local()` says so (Note
    [gradients left local] in parallel/data/ddp.py)."""

    def leave_gradients_local(self, when: Callable[[], bool]) -> None: ...


def declares(obj: object, capability: type) -> bool:
    """Whether `obj`'s class declares `capability` (inherits it), not merely has methods
    of those names: capabilities are stated where a class is defined."""
    return capability in type(obj).__mro__
