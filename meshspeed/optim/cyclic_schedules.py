"""DeepSpeed's LR range test and 1cycle schedules, with DeepSpeed's parameter names.

With b = last_batch_iteration + 1 (the batches seen so far):

  LRRangeTest  lr = min_lr * (1 + step_rate * k),  k = b / step_size, or
               floor(b / step_size) with `lr_range_test_staircase`.
  OneCycle     one cycle of T = first + second steps, then decay.
               In the cycle (last_batch_iteration < T), with p = b mod T:
                 s = p / first while p <= first (rising), else (T - p) / second (falling);
                 with a stair count n > 0 for that half, s = floor(s * n) / n, computed
                 from the integer p so that an exact stair is never lost to round-off;
                 lr = min_lr + (max_lr - min_lr) * s
                 momentum = max_mom - (max_mom - min_mom) * s   (moves against the lr)
               After it, with d = last_batch_iteration - T + 1 and D = decay_step_size:
                 lr = min_lr / (1 + decay_lr_rate * d / D)
                 momentum = max_mom * (1 + decay_mom_rate * d / D)
               (a rate or D of 0 holds min_lr / max_mom).

The 1cycle momentum is the first Adam beta of each param group (`betas[0]`); the second
beta is kept as the group has it (see Note [OneCycle's second beta]).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from numbers import Real

from torch.optim import Optimizer

from meshspeed.optim.schedule_base import LRSchedule, LRScheduleError, per_group

log = logging.getLogger("meshspeed")


def _number(value: object, name: str, *, minimum: float | None = None,
            positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise LRScheduleError(f"{name} must be a number, got {value!r}")
    if positive and value <= 0:
        raise LRScheduleError(f"{name} must be greater than 0, got {value!r}")
    if minimum is not None and value < minimum:
        raise LRScheduleError(f"{name} must be at least {minimum:g}, got {value!r}")
    return float(value)


class LRRangeTest(LRSchedule):
    """Raise the lr from `lr_range_test_min_lr` by `lr_range_test_step_rate` times it every
    `lr_range_test_step_size` steps, continuously or in stairs: a run that shows where the
    loss starts to diverge, to choose OneCycle's bounds."""

    def __init__(
        self,
        optimizer: Optimizer,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ):
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = per_group(lr_range_test_min_lr, len(optimizer.param_groups),
                                 "lr_range_test_min_lr")
        step_size = lr_range_test_step_size
        if isinstance(step_size, bool) or not isinstance(step_size, int) or step_size <= 0:
            raise LRScheduleError(
                f"lr_range_test_step_size must be a positive integer, got {step_size!r}"
            )
        if not isinstance(lr_range_test_staircase, bool):
            raise LRScheduleError(
                f"lr_range_test_staircase must be true or false, got {lr_range_test_staircase!r}"
            )
        self.step_size = step_size
        self.step_rate = _number(lr_range_test_step_rate, "lr_range_test_step_rate")
        self.staircase = lr_range_test_staircase
        self._apply()

    def _lrs_at(self, iteration: int) -> list[float]:
        intervals = (iteration + 1) / self.step_size
        if self.staircase:
            intervals = math.floor(intervals)
        factor = 1 + self.step_rate * intervals
        return [lr * factor for lr in self.min_lrs]


class OneCycle(LRSchedule):
    """One triangular cycle of the lr between `cycle_min_lr` and `cycle_max_lr` (first
    rising for `cycle_first_step_size` steps, then falling for `cycle_second_step_size`),
    the momentum cycling the other way between `cycle_max_mom` and `cycle_min_mom`, then a
    slow decay every `decay_step_size` steps. Bounds may be lists, one per param group."""

    def __init__(
        self,
        optimizer: Optimizer,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ):
        super().__init__(optimizer, last_batch_iteration)
        n = len(optimizer.param_groups)
        self.first_step_size = _number(cycle_first_step_size, "cycle_first_step_size",
                                       positive=True)
        self.second_step_size = (
            self.first_step_size if cycle_second_step_size is None
            else _number(cycle_second_step_size, "cycle_second_step_size", minimum=0)
        )
        self.total_size = self.first_step_size + self.second_step_size
        # A count of 0 (or DeepSpeed's command-line default, -1) means no stairs.
        self.first_stair_count = int(_number(cycle_first_stair_count, "cycle_first_stair_count"))
        self.second_stair_count = (
            self.first_stair_count if cycle_second_stair_count is None
            else int(_number(cycle_second_stair_count, "cycle_second_stair_count"))
        )
        self.decay_step_size = _number(decay_step_size, "decay_step_size", minimum=0)
        self.min_lrs = per_group(cycle_min_lr, n, "cycle_min_lr")
        self.max_lrs = per_group(cycle_max_lr, n, "cycle_max_lr")
        self.decay_lr_rate = _number(decay_lr_rate, "decay_lr_rate")
        self.min_moms = per_group(cycle_min_mom, n, "cycle_min_mom")
        self.max_moms = per_group(cycle_max_mom, n, "cycle_max_mom")
        self.decay_mom_rate = _number(decay_mom_rate, "decay_mom_rate")
        self.cycle_momentum = bool(cycle_momentum) and self._has_betas()
        self._apply()
        if self.cycle_momentum and last_batch_iteration == -1:
            self._write_betas(self.min_moms)  # Note [OneCycle's first momentum]

    @property
    def step_ratio(self) -> float:
        """The rising half's share of the cycle."""
        return self.first_step_size / self.total_size

    def _has_betas(self) -> bool:
        if all("betas" in group for group in self.optimizer.param_groups):
            return True
        log.warning(
            "OneCycle: momentum is not cycled because %s has no 'betas' in its param groups; "
            "set cycle_momentum to false to silence this",
            type(self.optimizer).__name__,
        )
        return False

    def _scale(self, iteration: int) -> float:
        """Where in the cycle `iteration` is: 0 at the bottom, 1 at the peak."""
        position = (iteration + 1) % self.total_size
        if position <= self.first_step_size:
            stairs, steps, done = self.first_stair_count, self.first_step_size, position
        else:
            stairs, steps = self.second_stair_count, self.second_step_size
            done = self.total_size - position
        if stairs > 0:
            return math.floor(done * stairs / steps) / stairs
        return done / steps

    def _decay_intervals(self, iteration: int) -> float:
        return (iteration - self.total_size + 1) / self.decay_step_size

    def _lrs_at(self, iteration: int) -> list[float]:
        if iteration < self.total_size:
            scale = self._scale(iteration)
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.decay_step_size == 0 or self.decay_lr_rate == 0:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * self._decay_intervals(iteration)
        return [lo / factor for lo in self.min_lrs]

    def _moms_at(self, iteration: int) -> list[float]:
        if iteration < self.total_size:
            scale = self._scale(iteration)
            return [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.decay_step_size == 0 or self.decay_mom_rate == 0:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * self._decay_intervals(iteration)
        return [hi * factor for hi in self.max_moms]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """Each group's `betas` at `last_batch_iteration`; None when momentum is not cycled."""
        if not self.cycle_momentum:
            return None
        return [(mom, float(group["betas"][1]))
                for mom, group in zip(self._moms_at(self.last_batch_iteration),
                                      self.optimizer.param_groups)]

    def _write_betas(self, moms: Sequence[float]) -> None:
        # Note [OneCycle's second beta]
        for group, mom in zip(self.optimizer.param_groups, moms):
            group["betas"] = (mom, group["betas"][1])

    def _apply(self) -> None:
        super()._apply()
        if self.cycle_momentum:
            self._write_betas(self._moms_at(self.last_batch_iteration))


# Note [OneCycle's first momentum]
# Every value a schedule writes follows the iteration, except this one, kept from DeepSpeed:
# a fresh OneCycle (last_batch_iteration -1) sets the lr to cycle_min_lr, as the formula
# gives, but the first beta to cycle_min_mom, where the formula gives cycle_max_mom. Only the
# first optimizer step runs with it, and for Adam-family optimizers (the ones with `betas`)
# that step does not depend on beta1: the bias-corrected first moment after one step is the
# gradient itself. So matching DeepSpeed costs nothing and keeps its observable state.
# The first `step()` writes the formula's value, and resuming (last_batch_iteration >= 0 or
# load_state_dict) writes the formula's value for that iteration.

# Note [OneCycle's second beta]
# DeepSpeed's OneCycle replaces each group's betas with (momentum, 0.99), discarding the
# second beta the optimizer was configured with (0.999 for torch's Adam default). meshspeed
# cycles only the first beta and keeps the group's second. To get DeepSpeed's numbers, give
# the optimizer betas [<any>, 0.99].
