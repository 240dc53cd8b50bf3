"""DeepSpeed's learning-rate schedules, with DeepSpeed's parameter names: the warmup
ones here, OneCycle and LRRangeTest in cyclic_schedules.py, and `build_scheduler`, which
makes any of them from the config's `scheduler` section.

`step()` is called once per optimizer step, after it; `last_batch_iteration` counts the
steps taken so far (-1 before the first). The value at iteration `i` follows DeepSpeed:

  warmup fraction  w(i) = log(i + 1) / log(W)  ("log")   or   i / W  ("linear"),
                   for 0 <= i < W, then 1.  W = max(2, warmup_num_steps), as in DeepSpeed.
  WarmupLR         lr = min_lr + (max_lr - min_lr) * w(i)
  WarmupDecayLR    as WarmupLR during warmup, then
                   lr = min_lr + (max_lr - min_lr) * max(0, (T - i) / max(1, T - W))
  WarmupCosineLR   lr = base_lr * r(i) with, during warmup,
                   r = warmup_min_ratio + (1 - warmup_min_ratio) * w(i), then
                   r = cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2,
                   p = min(1, (i - W + 1) / max(1, T - W))

where T = total_num_steps and base_lr is each param group's lr when the schedule is built.
State dicts are plain JSON-able dicts.
"""

from __future__ import annotations

import difflib
import inspect
import math
import warnings
from collections.abc import Sequence
from typing import Any

from torch.optim import Optimizer

from meshspeed.optim.cyclic_schedules import LRRangeTest, OneCycle
from meshspeed.optim.schedule_base import LRSchedule, LRScheduleError, per_group

WARMUP_TYPES = ("log", "linear")


def warmup_fraction(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """How far through warmup `iteration` is: 0.0 at iteration 0 (and before), 1.0 after."""
    if iteration <= 0:
        return 0.0
    if iteration >= warmup_num_steps:
        return 1.0
    if warmup_type == "log":
        return math.log(iteration + 1) / math.log(warmup_num_steps)
    return iteration / warmup_num_steps


class WarmupSchedule(LRSchedule):
    """Shared by the warmup schedules: validates and stores the warmup length and curve."""

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_num_steps: int,
        warmup_type: str,
        last_batch_iteration: int,
    ):
        if (isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int)
                or warmup_num_steps <= 0):
            raise LRScheduleError(
                f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}"
            )
        if warmup_type not in WARMUP_TYPES:
            # DeepSpeed's classes warn and use the log curve; a config is checked strictly
            # in build_scheduler before it gets here.
            warnings.warn(
                f"warmup_type {warmup_type!r} is not one of {WARMUP_TYPES}; using 'log' "
                "(as DeepSpeed does)", stacklevel=3)
            warmup_type = "log"
        super().__init__(optimizer, last_batch_iteration)
        # log(1) = 0 would divide by zero; DeepSpeed clamps the same way.
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type

    def _warmup(self, iteration: int) -> float:
        return warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)


class WarmupLR(WarmupSchedule):
    """Warm up from `warmup_min_lr` to `warmup_max_lr` over `warmup_num_steps`, then hold.

    `warmup_max_lr=None` (the default) means each param group's own lr, like current
    DeepSpeed; min and max may be lists with one value per param group.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ):
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        n = len(optimizer.param_groups)
        self._max_lr_arg = warmup_max_lr
        self.min_lrs = per_group(warmup_min_lr, n, "warmup_min_lr")
        self._on_base_lrs_changed()
        self._apply()

    def _on_base_lrs_changed(self) -> None:
        n = len(self.base_lrs)
        max_lr = self.base_lrs if self._max_lr_arg is None else self._max_lr_arg
        self.max_lrs = per_group(max_lr, n, "warmup_max_lr")

    def _gamma(self, iteration: int) -> float:
        return self._warmup(iteration)

    def _lrs_at(self, iteration: int) -> list[float]:
        gamma = self._gamma(iteration)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay back to `warmup_min_lr` at `total_num_steps`."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ):
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer,
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
            last_batch_iteration,
        )

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return self._warmup(iteration)
        remaining = self.total_num_steps - iteration
        return max(0.0, remaining / max(1, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(WarmupSchedule):
    """Warm up from `warmup_min_ratio * lr` to each group's lr, then cosine-decay to
    `cos_min_ratio * lr` at `total_num_steps` and stay there."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ):
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        self._apply()

    def lr_ratio(self, iteration: int) -> float:
        """The multiplier applied to every group's base lr at `iteration`."""
        if iteration < self.warmup_num_steps:
            return self.warmup_min_ratio + (1 - self.warmup_min_ratio) * self._warmup(iteration)
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, (iteration - self.warmup_num_steps + 1) / decay_steps)
        cosine = (1 + math.cos(math.pi * progress)) / 2  # 1 -> 0
        return max(0.0, self.cos_min_ratio + (1 - self.cos_min_ratio) * cosine)

    def get_lr_ratio(self) -> float:
        """The multiplier at `last_batch_iteration`."""
        return self.lr_ratio(self.last_batch_iteration)

    def _lrs_at(self, iteration: int) -> list[float]:
        ratio = self.lr_ratio(iteration)
        return [base * ratio for base in self.base_lrs]


SCHEDULERS: dict[str, type[LRSchedule]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
    "LRRangeTest": LRRangeTest,
}


def _did_you_mean(name: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def build_scheduler(optimizer: Optimizer, type_name: str, params: dict[str, Any]) -> LRSchedule:
    """Build a schedule from DeepSpeed's `"scheduler": {"type": ..., "params": {...}}`.

    Raises LRScheduleError (a ValueError) naming an unknown type or parameter, with a suggestion.
    """
    if type_name not in SCHEDULERS:
        raise LRScheduleError(
            f"unknown scheduler type {type_name!r}{_did_you_mean(type_name, list(SCHEDULERS))} "
            f"(supported: {', '.join(SCHEDULERS)})"
        )
    cls = SCHEDULERS[type_name]
    signature = inspect.signature(cls.__init__)
    accepted = [name for name in signature.parameters if name not in ("self", "optimizer")]
    for key in params:
        if key not in accepted:
            raise LRScheduleError(
                f"unknown parameter {key!r} for scheduler {type_name}"
                f"{_did_you_mean(key, accepted)} (accepted: {', '.join(accepted)})"
            )
    missing = [
        name
        for name in accepted
        if signature.parameters[name].default is inspect.Parameter.empty and name not in params
    ]
    if missing:
        raise LRScheduleError(f"scheduler {type_name} requires {', '.join(map(repr, missing))}")
    warmup_type = params.get("warmup_type", "log")
    if issubclass(cls, WarmupSchedule) and warmup_type not in WARMUP_TYPES:
        raise LRScheduleError(
            f"scheduler {type_name}: warmup_type must be one of {WARMUP_TYPES}, got {warmup_type!r}"
            f"{_did_you_mean(str(warmup_type), WARMUP_TYPES)}"
        )
    return cls(optimizer, **params)
