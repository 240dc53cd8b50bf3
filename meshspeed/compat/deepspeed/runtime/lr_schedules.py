"""`deepspeed.runtime.lr_schedules`: DeepSpeed's learning-rate schedules, their parameter
names and its command-line helpers, over meshspeed's (meshspeed/optim/schedulers.py,
meshspeed/optim/cyclic_schedules.py).

The classes are meshspeed's own, so `isinstance(engine.lr_scheduler, OneCycle)` holds for a
schedule the config built. accelerate checks `type(scheduler).__name__ in VALID_LR_SCHEDULES`
to decide whether a scheduler is DeepSpeed's own (and steps with the engine).
"""

from __future__ import annotations

import argparse
from typing import Any

from meshspeed.optim.cyclic_schedules import LRRangeTest, OneCycle
from meshspeed.optim.schedule_base import write_lrs
from meshspeed.optim.schedulers import WARMUP_TYPES, WarmupCosineLR, WarmupDecayLR, WarmupLR

LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"

EDGE_VALUE = "edge_value"
MID_VALUE = "mid_value"

CYCLE_FIRST_STEP_SIZE = "cycle_first_step_size"
CYCLE_FIRST_STAIR_COUNT = "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"
CYCLE_MIN_LR = "cycle_min_lr"
CYCLE_MAX_LR = "cycle_max_lr"
DECAY_LR_RATE = "decay_lr_rate"
CYCLE_MIN_MOM = "cycle_min_mom"
CYCLE_MAX_MOM = "cycle_max_mom"
DECAY_MOM_RATE = "decay_mom_rate"

WARMUP_MIN_LR = "warmup_min_lr"
WARMUP_MAX_LR = "warmup_max_lr"
WARMUP_NUM_STEPS = "warmup_num_steps"
WARMUP_TYPE = "warmup_type"
WARMUP_LOG_RATE, WARMUP_LINEAR_RATE = WARMUP_TYPES
WARMUP_MIN_RATIO = "warmup_min_ratio"
COS_MIN_RATIO = "cos_min_ratio"
TOTAL_NUM_STEPS = "total_num_steps"

# The command-line flags of each schedule: (name, type, default); type None is a switch.
_RANGE_TEST_FLAGS = [(LR_RANGE_TEST_MIN_LR, float, 0.001), (LR_RANGE_TEST_STEP_RATE, float, 1.0),
                     (LR_RANGE_TEST_STEP_SIZE, int, 1000), (LR_RANGE_TEST_STAIRCASE, None, False)]
_ONE_CYCLE_FLAGS = [(CYCLE_FIRST_STEP_SIZE, int, 1000), (CYCLE_FIRST_STAIR_COUNT, int, -1),
                    (CYCLE_SECOND_STEP_SIZE, int, -1), (CYCLE_SECOND_STAIR_COUNT, int, -1),
                    (DECAY_STEP_SIZE, int, 1000), (CYCLE_MIN_LR, float, 0.01),
                    (CYCLE_MAX_LR, float, 0.1), (DECAY_LR_RATE, float, 0.0),
                    (CYCLE_MIN_MOM, float, 0.8), (CYCLE_MAX_MOM, float, 0.9),
                    (DECAY_MOM_RATE, float, 0.0)]
_WARMUP_FLAGS = [(WARMUP_MIN_LR, float, 0.0), (WARMUP_MAX_LR, float, 0.001),
                 (WARMUP_NUM_STEPS, int, 1000), (WARMUP_TYPE, str, WARMUP_LOG_RATE)]
_COSINE_FLAGS = [(WARMUP_NUM_STEPS, int, 1000), (WARMUP_TYPE, str, WARMUP_LOG_RATE),
                 (WARMUP_MIN_RATIO, float, 0.01), (COS_MIN_RATIO, float, 0.01)]


def add_tuning_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's `--lr_schedule` and per-schedule flags, with its defaults."""
    group = parser.add_argument_group("Convergence Tuning", "learning-rate schedule flags")
    group.add_argument(f"--{LR_SCHEDULE}", type=str, default=None, help="LR schedule for training.")
    group.add_argument("--cycle_momentum", default=False, action="store_true",
                       help="cycle the momentum with OneCycle")
    seen = set()
    for name, kind, default in _RANGE_TEST_FLAGS + _ONE_CYCLE_FLAGS + _WARMUP_FLAGS + _COSINE_FLAGS:
        if name in seen:
            continue
        seen.add(name)
        if kind is None:
            group.add_argument(f"--{name}", default=default, action="store_true")
        else:
            group.add_argument(f"--{name}", type=kind, default=default)
    return parser


def parse_arguments() -> tuple[argparse.Namespace, list[str]]:
    """The schedule flags of `sys.argv`, and the arguments that are not theirs."""
    return add_tuning_arguments(argparse.ArgumentParser()).parse_known_args()


def _copy_flags(args: Any, params: dict[str, Any], flags: list[tuple[str, Any, Any]]) -> None:
    for name, _, _ in flags:
        value = getattr(args, name, None)
        if value is not None:
            params[name] = value


def override_params(args: Any, params: dict[str, Any]) -> None:
    """Copy every schedule flag set on `args` into `params`."""
    for flags in (_RANGE_TEST_FLAGS, _ONE_CYCLE_FLAGS, _WARMUP_FLAGS, _COSINE_FLAGS):
        _copy_flags(args, params, flags)


def get_config_from_args(args: Any) -> tuple[dict[str, Any] | None, str | None]:
    """A `scheduler` config section from the flags, or (None, why not)."""
    schedule = getattr(args, LR_SCHEDULE, None)
    if schedule is None:
        return None, f"--{LR_SCHEDULE} not specified on command line"
    if schedule not in VALID_LR_SCHEDULES:
        return None, f"{schedule} is not supported LR schedule"
    flags = {LR_RANGE_TEST: _RANGE_TEST_FLAGS, ONE_CYCLE: _ONE_CYCLE_FLAGS,
             WARMUP_COSINE_LR: _COSINE_FLAGS}.get(schedule, _WARMUP_FLAGS)
    params: dict[str, Any] = {}
    _copy_flags(args, params, flags)
    return {"type": schedule, "params": params}, None


def get_lr_from_config(config: dict[str, Any]) -> tuple[float | None, str]:
    """The peak lr a `scheduler` section names, or (None, why there is none)."""
    if "type" not in config:
        return None, "LR schedule type not defined in config"
    if "params" not in config:
        return None, "LR schedule params not defined in config"
    schedule, params = config["type"], config["params"]
    if schedule not in VALID_LR_SCHEDULES:
        return None, f"{schedule} is not a valid LR schedule"
    if schedule == WARMUP_COSINE_LR:
        return None, f"{WARMUP_COSINE_LR} scales the optimizer's lr; its params name no lr"
    keys = {LR_RANGE_TEST: LR_RANGE_TEST_MIN_LR, ONE_CYCLE: CYCLE_MAX_LR}
    key = keys.get(schedule, WARMUP_MAX_LR)
    return params[key], ""


def update_lr(param_groups: list[dict[str, Any]], lrs: list[float]) -> list[Any]:
    """Write `lrs` into `param_groups` (a tensor lr in place); returns the groups' lrs."""
    write_lrs(param_groups, lrs)
    return [group["lr"] for group in param_groups]

__all__ = [name for name in dir() if name.isupper() and not name.startswith("_")] + [
    "LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR",
    "add_tuning_arguments", "get_config_from_args", "get_lr_from_config", "override_params",
    "parse_arguments", "update_lr",
]
