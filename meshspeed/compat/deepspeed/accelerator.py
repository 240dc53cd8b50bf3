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

__all__ = ["Accelerator", "CpuAccelerator", "CudaAccelerator", "get_accelerator"]
