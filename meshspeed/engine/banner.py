"""What rank 0 says when an engine is built, and what its `steps_per_print` lines say.

The banner (one line each, through the "meshspeed" logger, Note [meshspeed's own handler]
in meshspeed/process/speak.py):

    meshspeed 0.1.0: pp 1 x dp 2 x cp 1 x tp 2 (4 processes), ZeRO stage 3, bfloat16, offload none
    model 12.35M parameters (the whole model); 40.12 MiB of model state on rank 0 before the first
    step (device 40.12 MiB)
    batch: micro batch 8 x accumulation 1 x dp 2 = 16 sequences per step
"""

from __future__ import annotations

import torch
from torch import nn

from meshspeed import comm
from meshspeed.parallel.pipeline.module import PipelineModule
from meshspeed.parallel.zero.init_shards import full_numel
from meshspeed.version import __version__

AXES = ("pp", "dp", "cp", "tp")


def whole_param_count(model: nn.Module, mesh) -> int:
    """Elements of the whole model's parameters, counted before the axes split them: a
    zero.Init parameter by its full shape; a PipelineModule holds its own stage only, so
    the stages' counts are summed over the pp group (a collective there; tied layers
    count once per stage holding them)."""
    own = sum(full_numel(p) for p in model.parameters())
    if isinstance(model, PipelineModule) and mesh.size("pp") > 1:
        return sum(comm.all_gather_object(own, group=mesh.group("pp")))
    return own


def mesh_text(mesh) -> str:
    """ "pp 1 x dp 2 x cp 1 x tp 2", with the expert split when there is one."""
    text = " x ".join(f"{axis} {mesh.size(axis)}" for axis in AXES)
    if mesh.size("ep") > 1:
        text += f" (ep {mesh.size('ep')} x edp {mesh.size('edp')})"
    return text


def _offload(cfg) -> str:
    zero = cfg.zero_optimization
    parts = [f"{what} to {block.device}" for what, block in
             (("optimizer", zero.offload_optimizer), ("parameters", zero.offload_param))
             if block is not None and block.device != "none"]
    return "offload " + (", ".join(parts) if parts else "none")


def count_text(n: int) -> str:
    """12,345 / 12.35M / 1.30B: parameter counts as people read them."""
    if n < 1_000_000:
        return f"{n:,}"
    return f"{n / 1e6:.2f}M" if n < 1_000_000_000 else f"{n / 1e9:.2f}B"


def _mib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def banner_lines(engine, params: int) -> list[str]:
    """The start-up banner for `engine` (whose model has `params` elements in all)."""
    cfg, mesh = engine.config, engine.topology
    world = comm.get_world_size() if comm.is_initialized() else 1
    dtype = str(cfg.precision_dtype).replace("torch.", "")
    memory = engine.memory_breakdown()
    tiers = ", ".join(f"{k} {_mib(v)}" for k, v in memory["tiers"].items() if v or k == "device")
    dp = mesh.size("dp")
    return [
        (f"meshspeed {__version__}: {mesh_text(mesh)} ({world} process{'es' if world != 1 else ''}), "
        f"ZeRO stage {cfg.zero_stage}, {dtype}, {_offload(cfg)}"),
        (f"model {count_text(params)} parameters (the whole model); {_mib(memory['total'])} of model "
        f"state on rank 0 before the first step ({tiers})"),
        (f"batch: micro batch {cfg.train_micro_batch_size_per_gpu} x accumulation "
        f"{cfg.gradient_accumulation_steps} x dp {dp} = {cfg.train_batch_size} samples per step"),
    ]


def step_line(engine, loss: torch.Tensor | None, figures: dict) -> str:
    """A `steps_per_print` line: step, loss, lr, then what was measured (grad norm when
    clipping computes it, the loss scale with fp16, tokens/s or samples/s, step time)."""
    loss_text = f"{float(loss):.4f}" if loss is not None else "n/a"
    lrs = ", ".join(f"{lr:.3g}" for lr in engine.learning_rates())
    parts = [f"step {engine.global_steps}", f"loss {loss_text}", f"lr {lrs}"]
    if engine.grad_norm is not None:
        parts.append(f"grad norm {engine.grad_norm:.4g}")
    if engine.config.fp16.enabled:
        parts.append(f"loss scale {engine.loss_scaler.scale:g}")
    seconds, steps = figures.get("seconds", 0.0), figures.get("steps", 0)
    if seconds > 0 and steps:
        if figures.get("tokens"):
            parts.append(f"{figures['tokens'] / seconds:,.0f} tokens/s")
        else:
            parts.append(f"{figures['samples'] / seconds:,.1f} samples/s")
        parts.append(f"{seconds / steps:.3f} s/step")
    return ", ".join(parts)
