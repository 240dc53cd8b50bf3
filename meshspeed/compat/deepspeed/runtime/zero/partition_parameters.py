"""DeepSpeed's `deepspeed.runtime.zero.partition_parameters` import path
(`from ...partition_parameters import ZeroParamStatus`); the code lives in meshspeed.zero."""

from meshspeed.compat.deepspeed.zero import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter",
           "unregister_external_parameter"]
