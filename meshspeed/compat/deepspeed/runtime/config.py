"""`deepspeed.runtime.config`: DeepSpeed's `DeepSpeedConfig`, as a view of meshspeed's
parsed config, with DeepSpeed's error type and optimizer names.

`DeepSpeedConfig(dict_or_path)` parses the config with meshspeed's `load_config` (every
check and message is meshspeed's) and answers DeepSpeed's attribute names from the
result: `train_batch_size`, `zero_config`, `float16_config`, `optimizer_name`, ... The
typed config itself is `meshspeed_config`. The sections are DeepSpeed views of
meshspeed's (runtime/zero/config.py, runtime/precision_config.py): a section meshspeed
parsed, plus the DeepSpeed-only keys the dict gave.

Note [DeepSpeed's batch rule]
DeepSpeed derives the batch triad from whichever of the three numbers are given, but
refuses a config that gives neither `train_batch_size` nor
`train_micro_batch_size_per_gpu`; meshspeed's `load_config` takes a micro batch of 1 then.
`DeepSpeedConfig` keeps DeepSpeed's rule, so code that builds one to validate a config
sees DeepSpeed's verdict. A batch that cannot be derived is a `BatchConfigError`, both
meshspeed's ConfigError and the AssertionError DeepSpeed raises; `initialize` keeps
meshspeed's rule.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from meshspeed import comm
from meshspeed.compat.deepspeed.runtime.config_utils import view_of
from meshspeed.compat.deepspeed.runtime.precision_config import (
    BFLOAT16,
    BFLOAT16_OLD,
    FP16,
    DeepSpeedBF16Config,
    DeepSpeedFP16Config,
)
from meshspeed.compat.deepspeed.runtime.zero.config import ZERO_OPTIMIZATION, DeepSpeedZeroConfig
from meshspeed.config.batch import BATCH_KEYS, resolve_batch
from meshspeed.config.errors import ConfigError
from meshspeed.config.loader import load_config, read_config
from meshspeed.config.root import MeshspeedConfig

__all__ = [
    "ADAGRAD_OPTIMIZER", "ADAMW_OPTIMIZER", "ADAM_OPTIMIZER", "DEEPSPEED_OPTIMIZERS", "LAMB_OPTIMIZER",
    "LION_OPTIMIZER", "MUADAMW_OPTIMIZER", "MUADAM_OPTIMIZER", "MUON_OPTIMIZER", "MUSGD_OPTIMIZER",
    "ONEBIT_ADAM_OPTIMIZER", "ONEBIT_LAMB_OPTIMIZER", "ZERO_ONE_ADAM_OPTIMIZER", "BatchConfigError",
    "DeepSpeedConfig", "DeepSpeedConfigError",
]

logger = logging.getLogger("meshspeed")

# DeepSpeed spells optimizer types in lower case; meshspeed matches them in any case
ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
MUADAM_OPTIMIZER = "muadam"
MUADAMW_OPTIMIZER = "muadamw"
MUSGD_OPTIMIZER = "musgd"
LION_OPTIMIZER = "lion"
MUON_OPTIMIZER = "muon"
DEEPSPEED_OPTIMIZERS = [ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER, MUADAM_OPTIMIZER,
                        MUADAMW_OPTIMIZER, MUSGD_OPTIMIZER, LION_OPTIMIZER, MUON_OPTIMIZER]
# the compressed-communication optimizers, by the names DeepSpeed's older releases exported
ONEBIT_ADAM_OPTIMIZER = "onebitadam"
ZERO_ONE_ADAM_OPTIMIZER = "zerooneadam"
ONEBIT_LAMB_OPTIMIZER = "onebitlamb"

# DeepSpeed's config error is meshspeed's: `except DeepSpeedConfigError` catches every
# config meshspeed refuses, and `except ValueError` keeps working too
DeepSpeedConfigError = ConfigError


class BatchConfigError(ConfigError, AssertionError):
    """The batch numbers do not make a triad (Note [DeepSpeed's batch rule])."""


class DeepSpeedConfig:
    """DeepSpeed's config object over meshspeed's `MeshspeedConfig` (see the module docstring)."""

    def __init__(self, config: str | Path | dict[str, Any], mpu: Any = None, mesh_device: Any = None):
        self._param_dict = config if isinstance(config, dict) else read_config(config)
        self.global_rank, self.world_size = _rank_and_dp_size(self._param_dict, mpu, mesh_device)
        parsed = load_config(self._param_dict, dp_world_size=None)  # the batch numbers as given
        for key in BATCH_KEYS:
            setattr(self, key, getattr(parsed, key) if key in parsed.batch_keys_given else None)
        self._configure_train_batch_size()
        self.meshspeed_config: MeshspeedConfig = load_config(
            parsed, dp_world_size=self.world_size, dp_source="DeepSpeedConfig's world size")
        self._read_sections(self.meshspeed_config)

    def _configure_train_batch_size(self) -> None:
        """Derive the batch numbers left None from the others (Note [DeepSpeed's batch rule])."""
        given = {k: getattr(self, k) for k in BATCH_KEYS if getattr(self, k) is not None}
        if "train_batch_size" not in given and "train_micro_batch_size_per_gpu" not in given:
            raise BatchConfigError("give train_batch_size or train_micro_batch_size_per_gpu (DeepSpeed "
                                   "derives the batch from one of them)")
        try:
            triad = resolve_batch(given, int(self.world_size), "DeepSpeedConfig's world size")
        except ConfigError as err:
            raise BatchConfigError(err.problems) from None
        for key, value in zip(BATCH_KEYS, triad):
            setattr(self, key, value)

    def _read_sections(self, cfg: MeshspeedConfig) -> None:
        raw = self._param_dict
        self.steps_per_print = cfg.steps_per_print
        self.dump_state = cfg.dump_state
        self.prescale_gradients = cfg.prescale_gradients
        self.gradient_predivide_factor = cfg.gradient_predivide_factor
        self.gradient_allreduce_op = cfg.gradient_allreduce_op
        self.communication_data_type = _dtype(cfg.communication_data_type)
        self.gradient_clipping = cfg.gradient_clipping
        self.wall_clock_breakdown = cfg.wall_clock_breakdown or cfg.flops_profiler.enabled
        self.sequence_parallel_size = cfg.sequence_parallel_size
        self.seed = cfg.seed

        zero_raw = raw.get(ZERO_OPTIMIZATION)
        self.zero_config = view_of(DeepSpeedZeroConfig, cfg.zero_optimization,
                                   zero_raw if isinstance(zero_raw, dict) else {})
        self.zero_optimization_stage = cfg.zero_stage
        self.zero_enabled = cfg.zero_stage > 0
        self.float16_config = view_of(DeepSpeedFP16Config, cfg.fp16, raw.get(FP16) or {})
        self.bfloat16_config = view_of(DeepSpeedBF16Config, cfg.bf16,
                                       raw.get(BFLOAT16) or raw.get(BFLOAT16_OLD) or {})

        optimizer, scheduler = cfg.optimizer, cfg.scheduler
        self.optimizer_name = _optimizer_name(optimizer.type) if optimizer else None
        self.optimizer_params = optimizer.params if optimizer and "params" in raw["optimizer"] else None
        self.scheduler_name = scheduler.type if scheduler else None
        self.scheduler_params = scheduler.params if scheduler and "params" in raw["scheduler"] else None
        self.pipeline = cfg.pipeline.model_dump()

        # DeepSpeed keys meshspeed accepts and does not act on, with DeepSpeed's defaults
        self.dataloader_drop_last = raw.get("dataloader_drop_last", False)
        self.zero_allow_untested_optimizer = raw.get("zero_allow_untested_optimizer", False)
        self.memory_breakdown = raw.get("memory_breakdown", False)

    @property
    def fp16_enabled(self) -> bool:
        return self.float16_config.enabled

    @property
    def bfloat16_enabled(self) -> bool:
        return self.bfloat16_config.enabled

    def print(self, name: str) -> None:
        """Log every setting of the resolved config, one per line."""
        logger.info("%s:", name)
        for key, value in sorted(self.meshspeed_config.to_dict().items()):
            logger.info("  %s %s %s", key, "." * max(1, 29 - len(key)), value)


def _rank_and_dp_size(raw: dict[str, Any], mpu: Any, mesh_device: Any) -> tuple[int, int]:
    """(this rank, data-parallel size) as DeepSpeed counts them: from the model-parallel unit
    or device mesh when given, else the world over sequence_parallel_size; (0, 1) with no
    process group."""
    if not comm.is_initialized():
        return 0, 1
    rank = comm.get_rank()
    if mpu is not None and hasattr(mpu, "get_data_parallel_world_size"):
        return rank, mpu.get_data_parallel_world_size()
    if mpu is not None:  # Ulysses' unit: the sequence-parallel degree divides the world
        return rank, comm.get_world_size() // mpu.get_sequence_parallel_world_size()
    if mesh_device is not None:
        return rank, comm.get_world_size(mesh_device.get_group(mesh_dim="data_parallel"))
    return rank, comm.get_world_size() // int(raw.get("sequence_parallel_size", 1))


def _optimizer_name(name: str) -> str:
    """DeepSpeed's spelling of an optimizer type: lower case for its own optimizers."""
    return name.lower() if name.lower() in DEEPSPEED_OPTIMIZERS else name


def _dtype(name: str | None):
    if name is None:
        return None
    import torch  # lazy: start-up cost, as in meshspeed/config/root.py

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]
