"""What every meshspeed learning-rate schedule shares: the iteration counter, writing lrs
into the optimizer's param groups, and a JSON-able state dict.

A schedule is a pure function of the iteration: `_lrs_at(i)` gives one lr per param group.
`step()` is called once per optimizer step, after it; `last_batch_iteration` counts the steps
taken so far (-1 before the first), and after every `step()` (and at construction, and after
`load_state_dict`) the param groups hold the values for `last_batch_iteration`.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Real
from typing import Any

import torch
from torch.optim import Optimizer


class LRScheduleError(ValueError):
    """A schedule parameter that cannot work (a step size of 0, a list of the wrong length)."""


def per_group(value: float | Sequence[float], n_groups: int, name: str) -> list[float]:
    """One value per param group: a scalar is repeated, a list must have one per group."""
    if isinstance(value, (list, tuple)):
        if len(value) != n_groups:
            raise LRScheduleError(
                f"{name} has {len(value)} values but the optimizer has {n_groups} param groups; "
                f"give one value per group or a single number"
            )
        values = list(value)
    else:
        values = [value] * n_groups
    for v in values:
        if isinstance(v, bool) or not isinstance(v, Real):
            raise LRScheduleError(f"{name} must be a number or a list of numbers, got {value!r}")
    return [float(v) for v in values]


def _as_float(lr: float | torch.Tensor) -> float:
    return float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)


def write_lrs(param_groups: Sequence[dict[str, Any]], lrs: Sequence[float]) -> None:
    """Set each group's lr; a tensor lr (capturable optimizers) is filled in place, so
    whoever holds that tensor sees the new value."""
    for group, lr in zip(param_groups, lrs):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


class LRSchedule:
    """Iteration bookkeeping, writing lrs, state. Subclasses define `_lrs_at(iteration)`,
    call `super().__init__` first and `self._apply()` once their fields are set."""

    def __init__(self, optimizer: Optimizer, last_batch_iteration: int):
        if isinstance(last_batch_iteration, bool) or not isinstance(last_batch_iteration, int):
            raise LRScheduleError(
                "last_batch_iteration must be an integer (-1 to start), "
                f"got {last_batch_iteration!r}"
            )
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        # The lrs the optimizer was built with. Recorded in the group (as torch's own
        # schedulers do) so a schedule rebuilt after optimizer.load_state_dict() still sees
        # the original lrs rather than the last scheduled ones.
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", _as_float(group["lr"]))
        self.base_lrs = [float(group["initial_lr"]) for group in optimizer.param_groups]
        self._last_lr: list[float] = []

    def _lrs_at(self, iteration: int) -> list[float]:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        """The lr of each param group at `last_batch_iteration`."""
        return self._lrs_at(self.last_batch_iteration)

    def get_last_lr(self) -> list[float]:
        """The lrs most recently written into the optimizer."""
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one iteration (or jump to `last_batch_iteration`) and set the lrs."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply()

    def _apply(self) -> None:
        lrs = self.get_lr()
        write_lrs(self.optimizer.param_groups, lrs)
        self._last_lr = lrs

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration, "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore; also accepts DeepSpeed's state dicts, which hold only the iteration."""
        self.last_batch_iteration = int(state["last_batch_iteration"])
        if "base_lrs" in state:
            self.base_lrs = [float(lr) for lr in state["base_lrs"]]
        self._on_base_lrs_changed()
        self._apply()

    def _on_base_lrs_changed(self) -> None:
        """Hook for schedules that derive per-group values from base_lrs."""
