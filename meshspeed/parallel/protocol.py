"""The protocol between the engine and a sharding strategy.

The engine drives every strategy (data parallel, ZeRO 1-3, with or without offload)
through these methods and nothing else; checkpoints, `GatheredParameters` and the memory
report use the ones marked for them. A strategy that is not `Strategy` fails the
`isinstance` check in `meshspeed.initialize`, instead of deep inside a step.

One step, as the engine calls it:

    begin_micro_step(boundary)        before forward of each micro-step
                                      (or hold_reductions(): accumulate only)
    (forward, loss.backward())
    finish_backward()                 after backward: reductions launched / settled
    prepare_step() -> masters         at the boundary: masters carry their gradients
    (clip over grad_norm_groups(), optimizer.step() on the masters)
    finish_step()                     masters -> parameters, gradients dropped
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from meshspeed.parallel.slices import OwnedSlice, ParamAccess


@runtime_checkable
class Strategy(Protocol):
    # parameter -> the fp32 tensor the optimizer steps on for it (the optimizer is built
    # from this map); keyed by parameter identity, valid while the strategy lives
    master_of: dict[int, nn.Parameter]

    # -- the step ------------------------------------------------------------------------------
    def begin_micro_step(self, boundary: bool) -> None: ...
    def hold_reductions(self) -> None:
        """The coming backward passes only accumulate `.grad`: nothing is reduced, even
        where every micro-step normally reduces (ZeRO 2-3), until `begin_micro_step(True)`
        and `finish_backward()` reduce all of it (pipelined passes that are not whole
        micro-steps: Note [micro-steps of a pipelined batch] in engine/pipeline.py)."""
        ...
    def finish_backward(self) -> None: ...
    def prepare_step(self) -> list[nn.Parameter]: ...
    def finish_step(self) -> None: ...
    def masters(self) -> list[nn.Parameter]: ...
    def grad_norm_groups(self) -> list[Any]:
        """Groups over which per-rank partial sums of gradient squares (and overflow flags)
        must be reduced: the groups the gradients are sharded over; empty when every rank
        holds all gradients (no collective is needed then)."""
        ...

    def deferred_grads(self) -> Any:
        """None when `prepare_step`'s masters carry their gradients as `.grad`. Otherwise
        the gradients are in files and the masters' `.grad` are placeholders: the object
        has `loss_scale` (set before the boundary backward), `nonfinite`, `norms(masters)`
        and `clip_(coef)` (Note [gradients in their NVMe slot] in offload/grad_files.py)."""
        ...

    # -- parameters ----------------------------------------------------------------------------
    @property
    def shards_params(self) -> bool: ...
    def gather_for_user(self, params: list[nn.Parameter]) -> Any: ...
    def publish_user_changes(self, params: list[nn.Parameter], src_rank: int) -> None: ...
    def release_for_user(self, token: Any) -> None: ...
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
