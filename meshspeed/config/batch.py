"""The batch-size triad: train_batch_size = micro batch * accumulation steps * DP size.

Owned by `meshspeed/engine`. The user may give any subset of the three; the data-parallel
world size is only known at launch, so the missing ones are derived by `resolve_batch`.
"""

from __future__ import annotations

import os
from typing import Any

from meshspeed.config.base import PositiveInt, StrictModel
from meshspeed.config.errors import ConfigError

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


class BatchSizes(StrictModel):
    """The three batch numbers as the user gave them; any may be missing."""

    train_batch_size: PositiveInt | None = None  # samples per optimizer step, all ranks
    train_micro_batch_size_per_gpu: PositiveInt | None = None  # samples per forward, one rank
    gradient_accumulation_steps: PositiveInt | None = None  # micro batches per step


def resolve_batch(
    given: dict[str, Any], dp_world_size: int, dp_source: str
) -> tuple[int, int, int]:
    """(train_batch_size, micro batch per GPU, accumulation steps), derived and checked.

    Two given derive the third. One alone: train_batch_size gives accumulation 1 and
    micro = train_batch_size / dp; micro or accumulation alone sets the other to 1.
    None: micro 1, accumulation 1.
    """
    if isinstance(dp_world_size, bool) or not isinstance(dp_world_size, int) or dp_world_size < 1:
        raise ConfigError(
            f"data-parallel world size must be a positive integer (got {dp_world_size!r}, "
            f"detected from {dp_source})"
        )
    b = BatchSizes.checked(given)
    tbs, mbs, gas = (
        b.train_batch_size,
        b.train_micro_batch_size_per_gpu,
        b.gradient_accumulation_steps,
    )
    dp = dp_world_size
    if tbs is None:
        mbs, gas = mbs or 1, gas or 1
        return mbs * gas * dp, mbs, gas
    if mbs is None and gas is None:
        gas = 1
    if mbs is None:
        if tbs % (gas * dp):
            raise ConfigError(
                _not_divisible(tbs, b, dp, dp_source, "train_micro_batch_size_per_gpu")
            )
        return tbs, tbs // (gas * dp), gas
    if gas is None:
        if tbs % (mbs * dp):
            raise ConfigError(_not_divisible(tbs, b, dp, dp_source, "gradient_accumulation_steps"))
        return tbs, mbs, tbs // (mbs * dp)
    if tbs != mbs * gas * dp:
        raise ConfigError(_inconsistent(tbs, mbs, gas, dp, dp_source))
    return tbs, mbs, gas


def _source(dp_source: str) -> str:
    if dp_source == "default":
        return "world size not detected from a launcher; the default was used"
    return f"world size detected from {dp_source}"


def _inconsistent(tbs: int, mbs: int, gas: int, dp: int, dp_source: str) -> str:
    product = mbs * gas * dp
    fixes = [f"train_batch_size to {product}"]
    if tbs % (mbs * dp) == 0:
        fixes.append(f"gradient_accumulation_steps to {tbs // (mbs * dp)}")
    if tbs % (gas * dp) == 0:
        fixes.append(f"train_micro_batch_size_per_gpu to {tbs // (gas * dp)}")
    hint = ""
    if tbs == mbs * gas and dp > 1 and os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        # accelerate filled in train_batch_size for one process: on a machine with no GPU it
        # finds no device backend and does not count the ranks (DeepSpeed fails the same way)
        hint = (" accelerate counted one process: with no GPU, name the gloo backend "
                '(Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")]), or '
                'PartialState(backend="gloo") before TrainingArguments).')
    return (
        f"train_batch_size {tbs} != train_micro_batch_size_per_gpu {mbs} * "
        f"gradient_accumulation_steps {gas} * data-parallel world size {dp} "
        f"(= {product}; {_source(dp_source)}). Set {', or '.join(fixes)}, "
        f"or give only two of the three and meshspeed derives the third.{hint}"
    )


def _not_divisible(tbs: int, b: BatchSizes, dp: int, dp_source: str, missing: str) -> str:
    other = (
        "train_micro_batch_size_per_gpu"
        if missing == "gradient_accumulation_steps"
        else "gradient_accumulation_steps"
    )
    value = getattr(b, other)
    shown = f"{other} {value}" if value is not None else f"{other} (not set, so 1)"
    step = (value or 1) * dp
    below, above = (tbs // step) * step, (tbs // step + 1) * step
    examples = f"{below} or {above}" if below else f"{above}"
    fix = f"Set train_batch_size to a multiple of {step} (e.g. {examples})"
    if value is not None and tbs % dp == 0:
        fix += f", or {other} to a divisor of {tbs // dp}"
    return (
        f"train_batch_size {tbs} is not divisible by {shown} * data-parallel world size {dp} "
        f"(= {step}; {_source(dp_source)}), so {missing} (not set) cannot be derived. {fix}."
    )
