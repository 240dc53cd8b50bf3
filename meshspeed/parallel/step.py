"""The gradients of one optimizer step, wherever they are: what `Strategy.prepare_step`
returns and the engine's step works on.

The engine's boundary is the same for every strategy: unscale and check for inf/NaN,
take the global norm, clip, step. What differs is where the gradients are and which
ranks hold which of them; `StepGradients` carries both, so the engine's step has no
branch per strategy:
- `masters`: the tensors the optimizer steps that have a gradient this step;
- `groups`: the groups whose ranks hold different gradients (the strategy's sharding);
  empty when every rank holds every gradient, so the norm needs no collective;
- `weights`: per master, a factor on its squared norm for gradients replicated over only
  part of `groups` (stage 0 with expert parallelism, 1-bit optimizers' local gradients);
- `files`: under NVMe offload, the gradients written to swap files as they landed, with
  their norms, non-finite flag and clipping coefficient (Note [gradients in their NVMe
  slot] in offload/grad_files.py); those masters' `.grad` are placeholders.
The other axes add their own ranks through a `NormScope` (pipeline stages, the
tensor-parallel group and which gradients are split over it, tied copies counted once).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from meshspeed.optim.clip import clip_by_norm_, clip_coef, global_grad_norm
from meshspeed.optim.precision import unscale_and_check

__all__ = ["GradientFiles", "NormScope", "StepGradients"]


class GradientFiles(Protocol):
    """Gradients kept in files for a step (offload/grad_files.py's GradFiles)."""

    nonfinite: bool

    def holds_grad(self, master: nn.Parameter) -> bool: ...
    def norms(self, masters: list[nn.Parameter]) -> torch.Tensor: ...
    def clip_(self, coef: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class NormScope:
    """What the axes besides the strategy add to the norm and the overflow check."""

    groups: tuple = ()  # more groups whose ranks hold different gradients (pipeline stages)
    tp_group: Any = None  # the tensor-parallel group, None without tensor parallelism
    tp_split: Callable[[list[nn.Parameter]], list[bool]] | None = None  # which are split over tp
    skip: frozenset[int] = frozenset()  # ids of masters another stage counts (tied copies)


@dataclass
class StepGradients:
    masters: list[nn.Parameter]
    groups: Sequence[Any] = ()
    weights: Callable[[list[nn.Parameter]], list[float]] | None = None
    files: GradientFiles | None = None
    _in_memory: list[torch.Tensor] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.masters = [m for m in self.masters if m.grad is not None]
        self._in_memory = [m.grad for m in self.masters
                           if self.files is None or not self.files.holds_grad(m)]

    def unscale_and_check(self, scale: float, scope: NormScope, device: torch.device | None) -> bool:
        """Divide the in-memory gradients by the loss scale (those in files were divided as
        they landed); True when any rank saw inf/NaN."""
        over = [*self.groups, *scope.groups, *([scope.tp_group] if scope.tp_group is not None else [])]
        seen = self.files is not None and self.files.nonfinite
        return unscale_and_check(self._in_memory, scale, over, device, local=seen)

    def norm(self, scope: NormScope, device: torch.device | None) -> torch.Tensor:
        """The global L2 norm, every element counted once across every rank."""
        counted = [m for m in self.masters if id(m) not in scope.skip]
        tp_split = scope.tp_split(counted) if scope.tp_split is not None else None
        return global_grad_norm(
            [m.grad for m in counted] if self.files is None else [], [*self.groups, *scope.groups],
            device, tp_group=scope.tp_group, tp_split=tp_split,
            norms=None if self.files is None else self.files.norms(counted),
            weights=None if self.weights is None else self.weights(counted))

    def clip_(self, max_norm: float, norm: torch.Tensor) -> None:
        clip_by_norm_(self._in_memory, max_norm, norm)
        if self.files is not None:
            self.files.clip_(clip_coef(max_norm, norm))
