"""DeepSpeed's older AutoTP training calls, kept so their scripts run unchanged.

`deepspeed.tp_model_init(model, tp_size, dtype)` and `set_autotp_mode(training=True)`
split nothing themselves (in DeepSpeed 0.19 either): `tp_model_init` records the request
on the model and `initialize` merges it with the config's `tensor_parallel` section
(the config wins where both speak; a disagreement is an error). The record lives on the
model, not in a module global, so two models in one process do not see each other's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

REQUEST = "_meshspeed_tp_request"  # attribute on the model: {"tp_size", "dtype", "tp_group"}


def tp_model_init(model: nn.Module, tp_size: int, dtype: torch.dtype, config: Any = None,
                  **kwargs: Any) -> nn.Module:
    """Record a tensor-parallel request for `initialize`; returns the model unchanged."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_model_init: tp_size must be a positive integer, got {tp_size!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"tp_model_init: dtype must be a torch.dtype, got {dtype!r}")
    unknown = set(kwargs) - {"tp_group"}
    if unknown:
        raise TypeError(f"tp_model_init: unexpected keyword(s) {sorted(unknown)}; it takes tp_group")
    object.__setattr__(model, REQUEST, {"tp_size": tp_size, "dtype": dtype,
                                        "tp_group": kwargs.get("tp_group")})
    return model


def set_autotp_mode(training: bool = False) -> None:
    """Accepted for compatibility: meshspeed splits for training whenever tp > 1."""


def request_of(model: nn.Module) -> dict | None:
    return getattr(model, REQUEST, None)
