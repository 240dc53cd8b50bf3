"""`deepspeed.runtime.zero.partition_parameters`: DeepSpeed's module of ZeRO-3's partitioned
parameters (`from ...partition_parameters import ZeroParamStatus`), and the names Hugging
Face transformers reads and swaps there around `zero.Init`.

transformers' `prevent_arange_dtype_change` replaces `zero_wrapper_for_fp_tensor_constructor`
while a model is built under `zero.Init`, recognising `torch.arange` by
`_orig_torch_arange`, and restores it after. DeepSpeed's Init wraps torch's tensor
constructors with it; meshspeed's patches nothing (Note [partitioned construction] in
meshspeed/parallel/zero/init.py: it records the build under a dispatch mode and casts the
parameters it keeps), so the swap changes nothing here, and the function keeps DeepSpeed's
meaning for code that calls it directly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from meshspeed.compat.deepspeed.zero import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    register_external_parameter,
    unregister_external_parameter,
)
from meshspeed.process.accelerator import get_accelerator

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "get_accelerator", "register_external_parameter",
           "unregister_external_parameter", "zero_wrapper_for_fp_tensor_constructor"]

_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn: Callable[..., torch.Tensor], target_fp_dtype: torch.dtype,
                                           target_device: Any = None) -> Callable[..., torch.Tensor]:
    """`fn` (a tensor constructor) making its tensors on `target_device` (default: this
    rank's accelerator device) and floating ones in `target_fp_dtype`, as DeepSpeed's Init
    has torch's constructors do."""
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None:
            kwargs["device"] = target_device if target_device is not None else get_accelerator().current_device_name()
        tensor = fn(*args, **kwargs)
        return tensor.to(target_fp_dtype) if tensor.is_floating_point() else tensor

    return wrapped
