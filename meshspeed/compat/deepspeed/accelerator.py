"""`meshspeed.accelerator`: DeepSpeed's import path for the accelerator,
``from deepspeed.accelerator import get_accelerator``.

The implementation lives in `meshspeed.process.accelerator`; this module only gives it the
path DeepSpeed scripts import it from. The object has DeepSpeed's method names
(device_name, current_device_name, set_device, manual_seed_all, is_bf16_supported,
communication_backend_name, pin_memory, on_accelerator, ...), see
Note [DeepSpeed accelerator names].
"""

from meshspeed.process.accelerator import (
    Accelerator,
    CpuAccelerator,
    CudaAccelerator,
    get_accelerator,
)

__all__ = ["SUPPORTED_ACCELERATOR_LIST", "Accelerator", "CpuAccelerator", "CudaAccelerator", "get_accelerator",
           "is_current_accelerator_supported"]

# the accelerators meshspeed runs on (DeepSpeed's list also has xpu, npu, mps, hpu, mlu, sdaa)
SUPPORTED_ACCELERATOR_LIST = ["cuda", "cpu"]


def is_current_accelerator_supported() -> bool:
    """True when the accelerator in use is one meshspeed supports (always, today)."""
    return get_accelerator().device_name() in SUPPORTED_ACCELERATOR_LIST
