"""DeepSpeed's `deepspeed.runtime.zero` import path, for scripts that import from there."""

from meshspeed.compat.deepspeed.zero import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter",
           "unregister_external_parameter"]
