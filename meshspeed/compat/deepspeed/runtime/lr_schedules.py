"""`deepspeed.runtime.lr_schedules`: DeepSpeed's learning-rate schedules and their names,
over meshspeed's (meshspeed/optim/schedulers.py).

accelerate checks `type(scheduler).__name__ in VALID_LR_SCHEDULES` to decide whether a
scheduler is DeepSpeed's own (and steps with the engine)."""

from __future__ import annotations

from meshspeed.optim.schedulers import WARMUP_TYPES, WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = ["VALID_LR_SCHEDULES", "WARMUP_COSINE_LR", "WARMUP_DECAY_LR", "WARMUP_LINEAR_RATE",
           "WARMUP_LOG_RATE", "WARMUP_LR", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]

WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]
WARMUP_LOG_RATE, WARMUP_LINEAR_RATE = WARMUP_TYPES
