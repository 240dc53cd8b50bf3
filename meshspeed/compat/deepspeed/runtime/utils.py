"""`meshspeed.runtime.utils`: the helpers DeepSpeed scripts call as `deepspeed.runtime.utils.X`."""

from __future__ import annotations

import gc
import random
from typing import Any

import numpy as np
import torch

from meshspeed import comm
from meshspeed.compat.deepspeed.runtime._grad_norm import (
    clip_grad_norm_,
    get_global_norm,
    is_model_parallel_parameter,
)
from meshspeed.process.accelerator import get_accelerator

__all__ = ["call_to_str", "clip_grad_norm_", "get_global_norm", "is_model_parallel_parameter",
           "see_memory_usage", "set_random_seed"]

_GIB = 2**30


def set_random_seed(seed: int) -> None:
    """Seed Python's `random`, NumPy's global generator and torch (every device).

    NumPy takes 32-bit seeds and torch 64-bit ones; larger seeds are reduced modulo those
    ranges so that any integer a script passes is accepted."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed % 2**63)  # also seeds every CUDA device


def see_memory_usage(message: str, force: bool = False) -> None:
    """Print device and host memory use under `message` on rank 0; only when `force`.

    Resets the device's peak counter afterwards, so consecutive calls report the peak of
    the stretch between them."""
    if not force:
        return

    if comm.is_initialized() and comm.get_rank() != 0:
        return
    gc.collect()  # drop unreachable tensors so that the figures are what is really held
    acc = get_accelerator()
    print(message)
    print(f"MA {acc.memory_allocated() / _GIB:.2f} GB  Max_MA {acc.max_memory_allocated() / _GIB:.2f} GB  "
          f"CA {acc.memory_reserved() / _GIB:.2f} GB  Max_CA {acc.max_memory_reserved() / _GIB:.2f} GB")
    total, available = get_accelerator("cpu").total_memory(), get_accelerator("cpu").available_memory()
    used = total - available
    print(f"CPU Virtual Memory:  used = {used / _GIB:.2f} GB, percent = {100 * used / total:.1f}%")
    acc.reset_peak_memory_stats()


def call_to_str(base: str, *args: Any, **kwargs: Any) -> str:
    """How a call of `base` with these arguments reads: `call_to_str("f", 1, k="v")` is
    `"f(1, k='v')"` (arguments as repr, keywords after positionals)."""
    parts = [repr(a) for a in args] + [f"{key}={value!r}" for key, value in kwargs.items()]
    return f"{base}({', '.join(parts)})"
