"""`deepspeed.runtime.activation_checkpointing.checkpointing`, DeepSpeed's activation
checkpointing API; `deepspeed.checkpointing` is this same module object, as in DeepSpeed.

    import deepspeed
    deepspeed.checkpointing.configure(mpu, deepspeed_config=args.deepspeed_config)
    deepspeed.checkpointing.model_parallel_cuda_manual_seed(1234)
    hidden = deepspeed.checkpointing.checkpoint(block, hidden, mask)

What each does: meshspeed/parallel/activation_checkpoint.py (checkpoint,
non_reentrant_checkpoint), meshspeed/parallel/activation_setup.py (configure and the
config block) and meshspeed/parallel/rng_tracker.py (the RNG tracker);
docs/activation_checkpointing.md.

Note [DeepSpeed's checkpointing globals]
DeepSpeed keeps its settings in module globals (`PARTITION_ACTIVATIONS`,
`CPU_CHECKPOINT`, `num_layers`, `mpu`, `mp_size`, ...), and scripts and tests read them,
or save and assign them back around a configure(). Here they are properties of the
module (its class is a ModuleType subclass): reading one reads the setting in force
(meshspeed.parallel.activation_setup), assigning one changes that setting through
`activation_setup.update`, so a checkpoint after the assignment behaves as assigned.
`mp_rank`, `mp_size` and `mp_group` are the configured tensor-parallel group and can only
be read (assign `mpu` instead).
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

from meshspeed.parallel import activation_setup as _setup
from meshspeed.parallel.activation_checkpoint import (
    checkpoint,
    current_policy,
    non_reentrant_checkpoint,
)
from meshspeed.parallel.activation_setup import (
    CheckpointingRuleError,
    configure,
    is_configured,
    model_parallel_cuda_manual_seed,
    partition_activations_in_checkpoint,
    reset,
    set_num_layers,
)
from meshspeed.parallel.rng_tracker import (
    CudaRNGStatesTracker,
    RNGStatesTracker,
    get_cuda_rng_tracker,
)

__all__ = [
    "CheckpointingRuleError",
    "CudaRNGStatesTracker",
    "RNGStatesTracker",
    "checkpoint",
    "configure",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "non_reentrant_checkpoint",
    "partition_activations_in_checkpoint",
    "reset",
    "set_num_layers",
]

# DeepSpeed's global -> the config block's field it shows
_FIELDS = {
    "PARTITION_ACTIVATIONS": "partition_activations",
    "CONTIGUOUS_CHECKPOINTING": "contiguous_memory_optimization",
    "num_layers": "number_checkpoints",
    "CPU_CHECKPOINT": "cpu_checkpointing",
    "SYNCHRONIZE": "synchronize_checkpoint_boundary",
    "PROFILE_TIME": "profile",
}


def _field(global_name: str) -> property:
    field = _FIELDS[global_name]

    def read(_module: ModuleType) -> Any:
        return getattr(_setup.current_block(), field)

    def write(_module: ModuleType, value: Any) -> None:
        _setup.update(**{field: value})

    return property(read, write, doc=f"DeepSpeed's {global_name}: activation_checkpointing.{field}")


def _read_mpu(_module: ModuleType) -> Any:
    return _setup.current_mpu()


def _write_mpu(_module: ModuleType, value: Any) -> None:
    _setup.update(mpu=value, clear_mpu=value is None)


def _read_enabled(_module: ModuleType) -> bool:
    return is_configured()


def _write_enabled(_module: ModuleType, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"deepspeed_checkpointing_enabled must be True or False, got {value!r}")
    _setup.update(configured=value)


class _CheckpointingModule(ModuleType):
    """This module, with DeepSpeed's globals as views of the setting (Note [DeepSpeed's
    checkpointing globals])."""

    PARTITION_ACTIVATIONS = _field("PARTITION_ACTIVATIONS")
    CONTIGUOUS_CHECKPOINTING = _field("CONTIGUOUS_CHECKPOINTING")
    num_layers = _field("num_layers")
    CPU_CHECKPOINT = _field("CPU_CHECKPOINT")
    SYNCHRONIZE = _field("SYNCHRONIZE")
    PROFILE_TIME = _field("PROFILE_TIME")
    mpu = property(_read_mpu, _write_mpu, doc="DeepSpeed's mpu: the object configure() was given")
    deepspeed_checkpointing_enabled = property(_read_enabled, _write_enabled,
                                               doc="DeepSpeed's flag: whether configure() ran")
    mp_rank = property(lambda _m: current_policy().rank, doc="this rank's place in the tp group")
    mp_size = property(lambda _m: current_policy().size, doc="the tp group's size")
    mp_group = property(lambda _m: current_policy().group, doc="the tp group (None: none)")


sys.modules[__name__].__class__ = _CheckpointingModule
