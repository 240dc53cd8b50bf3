"""The `optimizer` and `scheduler` sections. Owned by `meshspeed/optim`.

`params` are passed to the optimizer / scheduler constructor as keyword arguments and
are checked there, against the constructor's signature.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from meshspeed.config.base import StrictModel, closest

OPTIMIZERS = ("Adam", "AdamW", "SGD", "OneBitAdam", "ZeroOneAdam", "OneBitLamb")
# Optimizers DeepSpeed ships that meshspeed has not implemented.
DEEPSPEED_ONLY_OPTIMIZERS = (
    "Lamb",
    "Adagrad",
    "Lion",
    "Muon",
    "MuAdam",
    "MuAdamW",
    "MuSGD",
)
SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
DEEPSPEED_ONLY_SCHEDULERS: tuple[str, ...] = ()


def canonical_type(
    value: Any, kind: str, supported: tuple[str, ...], known: tuple[str, ...]
) -> Any:
    """Map any capitalisation of a supported name to its spelling, or explain the miss."""
    if not isinstance(value, str):
        return value  # strict str validation reports the type
    names = {n.lower(): n for n in supported}
    if value.lower() in names:
        return names[value.lower()]
    choices = ", ".join(supported)
    if value.lower() in {n.lower() for n in known}:
        raise ValueError(
            f"a DeepSpeed {kind} meshspeed does not implement yet; supported types: {choices}"
        )
    guess = closest(value.lower(), names)
    hint = f"did you mean '{names[guess]}'? " if guess else ""
    raise ValueError(f"unknown {kind} type; {hint}supported types: {choices}")


class OptimizerConfig(StrictModel):
    """Which optimizer meshspeed builds when the caller passes none."""

    type: str  # Adam, AdamW, SGD, OneBitAdam, ZeroOneAdam or OneBitLamb, in any capitalisation
    params: dict[str, Any] = Field(default_factory=dict)  # e.g. {"lr": 1e-3, "betas": [0.9, 0.999]}

    @field_validator("type", mode="before")
    @classmethod
    def _type(cls, value: Any) -> Any:
        return canonical_type(value, "optimizer", OPTIMIZERS, DEEPSPEED_ONLY_OPTIMIZERS)


class SchedulerConfig(StrictModel):
    """Which learning-rate schedule meshspeed builds when the caller passes none."""

    type: str  # WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle or LRRangeTest
    params: dict[str, Any] = Field(default_factory=dict)  # e.g. {"warmup_num_steps": 1000}

    @field_validator("type", mode="before")
    @classmethod
    def _type(cls, value: Any) -> Any:
        return canonical_type(value, "scheduler", SCHEDULERS, DEEPSPEED_ONLY_SCHEDULERS)
