"""DeepSpeed's top-level entry points over meshspeed's composition root.

`initialize` takes DeepSpeed's arguments (`args.deepspeed_config`, `config_params`,
`dist_init_required`, `distributed_port`, ...), starts the process group as DeepSpeed
would, and builds the engine with DeepSpeed's engine classes (the loop plus DeepSpeed's
getters, runtime/engine.py); it returns DeepSpeed's 4-tuple. It also points DeepSpeed's
`deepspeed.utils.groups` accessors at the new mesh: those are DeepSpeed's global state,
kept here, at the edge (meshspeed passes groups explicitly: `engine.mesh`).
`tp_model_init` / `set_autotp_mode` are DeepSpeed's older AutoTP calls.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from meshspeed import comm
from meshspeed.compat.deepspeed.runtime.engine import DeepSpeedEngine
from meshspeed.compat.deepspeed.runtime.pipe.engine import PipelineEngine
from meshspeed.compat.deepspeed.utils import groups
from meshspeed.config import MeshspeedConfig
from meshspeed.engine.build import build
from meshspeed.optim.no_optimizer import NoOptimizer
from meshspeed.process.distributed import init_distributed
from meshspeed.tensor_parallel.request import record_request

__all__ = ["initialize", "set_autotp_mode", "tp_model_init"]


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Any = None,
    model_parameters: Any = None,
    training_data: torch.utils.data.Dataset | None = None,
    lr_scheduler: Any = None,
    distributed_port: int | None = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: str | dict | MeshspeedConfig | None = None,
    config_params: str | dict | None = None,
    mesh_param: Any = None,
    dataloader_seed: int = 0,
):
    """Returns `(engine, optimizer, dataloader, lr_scheduler)`, as DeepSpeed does."""
    if model is None:
        raise MissingModelError("initialize() needs model=<your nn.Module>")
    if config is None:
        config = config_params
        for attr in ("deepspeed_config", "deepscale_config"):  # DeepSpeed's argparse flags
            if config is None:
                config = getattr(args, attr, None)
    if not comm.is_initialized():
        init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    engine, opt, loader, scheduler = build(
        model, config, optimizer=optimizer, model_parameters=model_parameters, training_data=training_data,
        lr_scheduler=lr_scheduler, mpu=mpu, mesh_param=mesh_param, collate_fn=collate_fn,
        dataloader_seed=dataloader_seed, engine_types=(DeepSpeedEngine, PipelineEngine))
    groups.set_layout(engine.mesh)  # deepspeed.utils.groups' accessors answer from it
    if isinstance(opt, NoOptimizer):  # Note [an engine without an optimizer]
        return engine, None, loader, scheduler
    opt.overflow = False  # DeepSpeed's optimizers say whether the last step was skipped (runtime/engine.py)
    return engine, opt, loader, scheduler


class MissingModelError(ValueError, AssertionError):
    """initialize() without a model (DeepSpeed asserts, so an AssertionError too)."""


def tp_model_init(model: nn.Module, tp_size: int, dtype: torch.dtype, config: Any = None,
                  **kwargs: Any) -> nn.Module:
    """Record a tensor-parallel request for `initialize`; returns the model unchanged
    (meshspeed/tensor_parallel/request.py)."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_model_init: tp_size must be a positive integer, got {tp_size!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"tp_model_init: dtype must be a torch.dtype, got {dtype!r}")
    unknown = set(kwargs) - {"tp_group"}
    if unknown:
        raise TypeError(f"tp_model_init: unexpected keyword(s) {sorted(unknown)}; it takes tp_group")
    record_request(model, tp_size, dtype, kwargs.get("tp_group"))
    return model


def set_autotp_mode(training: bool = False) -> None:
    """Accepted for compatibility: meshspeed splits for training whenever tp > 1."""
