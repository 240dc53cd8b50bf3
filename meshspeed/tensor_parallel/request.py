"""A tensor-parallel request recorded on a model before initialize.

DeepSpeed's older AutoTP calls (`tp_model_init(model, tp_size, dtype)`, in
meshspeed/compat/api.py) split nothing themselves: they record what they ask for on the
model, and `apply_tp` merges it with the config's `tensor_parallel` section (the config
wins where both speak; a disagreement is an error). The record lives on the model, not
in a module global, so two models in one process do not see each other's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

REQUEST = "_meshspeed_tp_request"  # attribute on the model: {"tp_size", "dtype", "tp_group"}


def record_request(model: nn.Module, tp_size: int, dtype: torch.dtype, tp_group: Any = None) -> None:
    object.__setattr__(model, REQUEST, {"tp_size": tp_size, "dtype": dtype, "tp_group": tp_group})


def request_of(model: nn.Module) -> dict | None:
    return getattr(model, REQUEST, None)
