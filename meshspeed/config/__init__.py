"""Typed meshspeed config: one small frozen model per owner, DeepSpeed JSON at the edge.

`load_config(path_or_dict, dp_world_size=..., dp_source=...)` is the entry point.
DeepSpeed keys meshspeed does not act on yet are listed in `known_keys.py`.
"""

from meshspeed.config.activation import ActivationCheckpointingConfig
from meshspeed.config.batch import BATCH_KEYS, BatchSizes, resolve_batch
from meshspeed.config.checkpoint import CheckpointConfig
from meshspeed.config.comms import CommsLoggerConfig
from meshspeed.config.errors import ConfigError
from meshspeed.config.known_keys import ACCEPTED_UNUSED
from meshspeed.config.loader import load_config
from meshspeed.config.monitor import FileMonitorConfig, FlopsProfilerConfig, WandbConfig
from meshspeed.config.offload import AioConfig, OffloadOptimizerConfig, OffloadParamConfig
from meshspeed.config.optim import OptimizerConfig, SchedulerConfig
from meshspeed.config.precision import BF16Config, FP16Config
from meshspeed.config.root import MeshspeedConfig
from meshspeed.config.zero import ZeroConfig

__all__ = [
    "ACCEPTED_UNUSED",
    "BATCH_KEYS",
    "ActivationCheckpointingConfig",
    "AioConfig",
    "BF16Config",
    "BatchSizes",
    "CheckpointConfig",
    "CommsLoggerConfig",
    "ConfigError",
    "FP16Config",
    "FileMonitorConfig",
    "FlopsProfilerConfig",
    "MeshspeedConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "WandbConfig",
    "ZeroConfig",
    "load_config",
    "resolve_batch",
]
