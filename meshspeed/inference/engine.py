"""`init_inference(model, config=None, **kwargs)` and the engine it returns.

Order of work (each step checks its input before changing anything):
  1. config: typed, merged from `config` and keyword arguments (config.py);
  2. dtype: a tiny op in that dtype on the model's device, so a dtype the device cannot
     run fails here in one sentence rather than deep inside the first forward;
  3. tensor parallelism: tp_size must divide the world size and the model's query and
     key/value heads; the model is split in place by `apply_tensor_parallel` with its
     automatic (Hugging Face) or own (`tp_plan`) plan, its vocabulary head gathering the
     logits (Note [full logits on every rank]);
  4. the cast to the compute dtype (parameters built on the meta device get storage for
     their local shard only), then the checkpoint, read straight into each rank's shards
     (checkpoint.py);
  5. weight-only quantization or ZeRO-Inference partitioning, when asked for.

Note [full logits on every rank]
Training keeps the logits split over the vocabulary and uses the vocab-parallel loss.
Inference needs whole rows: Hugging Face's `generate` (on `engine.module`) takes an
argmax or samples over them, and `engine(...)` must give what the unsplit model gives. So
the plan's "loss" entries are dropped (the model's own cross-entropy sees whole logits)
and the vocab head is switched to `gather_output`: one all-gather of (tokens, vocab/tp)
per forward, padding columns trimmed. Every rank then holds identical logits, so ranks
sampling with the same seed choose the same tokens.

Note [a quantized model is frozen]
Quantized layers have no gradient, and the embeddings, norms and biases left in full
precision are only there to serve. While they required grad, every call of the engine with
grad enabled built an autograd graph that kept activations (and, before Note [no float
weight in the graph], each layer's rebuilt fp32 weight) alive as long as the caller held
the output. So `init_inference(..., quant={"enabled": True})` sets requires_grad=False on
every parameter left: the process then holds the integer weights and those parameters,
less than the fp32 model (issue 34).
"""

from __future__ import annotations

import fnmatch
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshspeed.config.errors import ConfigError
from meshspeed.inference.checkpoint import LoadStats, load_into_shards
from meshspeed.inference.config import (
    DeepSpeedInferenceConfig,
    InferenceConfig,
    load_inference_config,
    report_no_effect,
)
from meshspeed.inference.generation import generate
from meshspeed.inference.inject import inject_kernels
from meshspeed.inference.quant import quantize_weights
from meshspeed.inference.runners import runner_for
from meshspeed.inference.zero_inference import partition_for_inference
from meshspeed.process.distributed import init_distributed
from meshspeed.tensor_parallel.apply import apply_tensor_parallel, default_plan
from meshspeed.topology import ParallelDims, build_topology
from meshspeed.topology.degrees import launch_hint

log = logging.getLogger("meshspeed")


def init_inference(model: nn.Module, config: Any = None, **kwargs: Any) -> InferenceEngine:
    """DeepSpeed's `init_inference`: `config` is None, a dict, a JSON file path or an
    InferenceConfig; keyword arguments are config keys (merged with `config`; one key
    with two different values is a ConfigError). Returns an InferenceEngine wrapping
    `model`, which is changed in place (split, cast, loaded)."""
    return InferenceEngine(model, load_inference_config(config, **kwargs))


class InferenceEngine(nn.Module):
    """A model prepared for inference: called like the model (same outputs, whole logits
    on every rank); `.module` is the model itself, so `engine.module.generate(...)` (Hugging
    Face) keeps working; `generate` runs meshspeed's own generation.

    Attributes: config (InferenceConfig), topology (the meshspeed Topology, None on one
    process), load_stats (LoadStats of the checkpoint read, None without one)."""

    def __init__(self, model: nn.Module, config: InferenceConfig | dict | None = None) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"init_inference needs a torch.nn.Module, got {type(model).__name__}")
        cfg = config if isinstance(config, InferenceConfig) else load_inference_config(config)
        self.config = cfg
        self.topology = None
        self.load_stats: LoadStats | None = None
        device = _target_device(model)
        check_dtype_runs(cfg.torch_dtype, device)
        if cfg.tp_size > 1 or cfg.zero.stage == 3:
            self.topology = _build_topology(model, cfg.tp_size, device)
        report_no_effect(cfg, dist.get_rank() if dist.is_initialized() else 0)
        if cfg.tp_size > 1:
            split_for_inference(model, self.topology)
        materialize_meta(model, device, cfg.torch_dtype, has_checkpoint=bool(cfg.checkpoint))
        model.to(device=device, dtype=cfg.torch_dtype)
        if cfg.checkpoint:
            self.load_stats = load_into_shards(model, os.path.join(cfg.base_dir, cfg.checkpoint))
        if cfg.quant.enabled:
            _quantize(model, cfg)
        self.injected = _inject(model, cfg)
        self.zero_inference = _partition(model, cfg, self.topology) if cfg.zero.stage == 3 else None
        self.module = model.eval()
        self._runner = None

    @property
    def mp_world_size(self) -> int:
        """DeepSpeed's name for the tensor-parallel degree."""
        return self.config.tp_size

    @property
    def dtype(self) -> torch.dtype:
        return self.config.torch_dtype

    @property
    def module_or_runner(self) -> Any:
        """What generation runs: meshspeed's cached runner of the prepared model (made once;
        under ZeRO-Inference each of its layers gathers its unit, as the model's own decoder
        layers do)."""
        if self._runner is None:
            self._runner = runner_for(self.module)
            if self.zero_inference is not None:
                for i, layer in enumerate(self._runner.layers):
                    self.zero_inference.attach(layer, i)
        return self._runner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def generate(self, input_ids: Any, max_new_tokens: int | None = None, **kwargs: Any) -> Any:
        """meshspeed's generation (`meshspeed.inference.generation.generate`) with the
        config's max_out_tokens; a prompt longer than max_out_tokens is a ValueError."""
        longest = _prompt_length(input_ids)
        if longest > self.config.max_out_tokens:
            raise ValueError(f"prompt of {longest} tokens is longer than max_out_tokens="
                             f"{self.config.max_out_tokens}; shorten the prompt or raise "
                             "max_out_tokens (alias max_tokens) in the init_inference config")
        if max_new_tokens is not None:
            kwargs["max_new_tokens"] = max_new_tokens
        return generate(self.module_or_runner, input_ids, max_out_tokens=self.config.max_out_tokens,
                        **kwargs)


def _prompt_length(input_ids: Any) -> int:
    if torch.is_tensor(input_ids):
        return int(input_ids.shape[-1]) if input_ids.dim() else 1
    return max((len(p) for p in input_ids), default=0)  # a list of prompts


def _target_device(model: nn.Module) -> torch.device:
    """Where the model runs: where it is, or the rank's GPU for a CPU (or meta) model when
    CUDA is available (as DeepSpeed moves it); the CPU for a meta model without CUDA."""
    param = next((p for p in model.parameters() if not p.is_meta), None)
    device = param.device if param is not None else torch.device("cpu")
    if device.type == "cpu" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _tiny_op(dtype: torch.dtype, device: torch.device) -> None:
    """The kinds of op every transformer forward runs: matmul, softmax, norm, activation."""
    x = torch.ones(4, 4, dtype=dtype, device=device)
    y = torch.nn.functional.layer_norm(torch.softmax(x @ x, dim=-1), (4,))
    torch.nn.functional.gelu(y).sum().item()


def check_dtype_runs(dtype: torch.dtype, device: torch.device) -> None:
    """ConfigError in one sentence when `device` cannot compute in `dtype`."""
    try:
        _tiny_op(dtype, device)
    except (RuntimeError, TypeError, NotImplementedError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"dtype: {str(dtype).replace('torch.', '')} cannot run on {device} "
                          f"(a small matmul failed: {reason}); use dtype fp32 or a device that "
                          "supports it") from None


def _build_topology(model: nn.Module, tp: int, device: torch.device):
    if not dist.is_initialized():
        init_distributed(verbose=False)
    world = dist.get_world_size()
    if world % tp:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ConfigError(f"tensor_parallel.tp_size {tp} does not divide the world size {world}; "
                          f"use one of {divisors} or {launch_hint(tp, world)}")
    check_heads(model, tp)
    return build_topology(ParallelDims(world, tp=tp), device_type=device.type)


def _heads(model: nn.Module) -> tuple[int | None, int | None]:
    """(query heads, key/value heads) from a Hugging Face or meshspeed GPT config."""
    cfg = getattr(model, "config", None)
    q = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    kv = getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "n_kv_head", None) or q
    return q, kv


def check_heads(model: nn.Module, tp: int) -> None:
    """ConfigError when tp does not divide the query or key/value heads: a rank must hold
    whole heads, or attention would mix halves of different heads."""
    q, kv = _heads(model)
    for count, what in ((q, "attention heads"), (kv, "key/value heads")):
        if count and count % tp:
            ok = [d for d in range(1, count + 1) if count % d == 0]
            raise ConfigError(f"tensor_parallel.tp_size {tp} does not divide the {count} {what} of "
                              f"{type(model).__name__}; use a tp_size in {ok}")


def split_for_inference(model: nn.Module, topology: Any) -> nn.Module:
    """apply_tensor_parallel with the model's default plan, minus the vocab-parallel loss,
    and the vocab head gathering whole logits (Note [full logits on every rank])."""
    plan = {k: v for k, v in default_plan(model).items() if _kind(v) != "loss"}
    apply_tensor_parallel(model, topology, plan)
    heads = [k for k, v in plan.items() if _kind(v) == "vocab_head"]
    for name, module in model.named_modules():
        if any(fnmatch.fnmatchcase(name, glob) for glob in heads):
            module.gather_output = True
    return model


def materialize_meta(model: nn.Module, device: torch.device, dtype: torch.dtype, *,
                     has_checkpoint: bool) -> None:
    """Give parameters on the meta device real (uninitialised) storage of their local
    shape, so a model built without memory (`torch.device("meta")`, accelerate's
    `init_empty_weights`) is split first and then only this rank's shards are allocated
    and filled from the checkpoint. Tied parameters stay one Parameter. Buffers must be
    real already: a checkpoint need not hold them (rotary tables are not saved)."""
    on_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if not on_meta:
        return
    if not has_checkpoint:
        raise ConfigError(f"{len(on_meta)} parameters of {type(model).__name__} are on the meta "
                          f"device (first: {on_meta[0]!r}) and no checkpoint is given to fill them; "
                          "pass checkpoint=... or build the model with real weights")
    meta_buffers = [n for n, b in model.named_buffers() if b.is_meta]
    if meta_buffers:
        raise ConfigError(f"buffer {meta_buffers[0]!r} of {type(model).__name__} is on the meta "
                          "device; checkpoints do not hold every buffer, so build the model with "
                          "meta parameters only (accelerate's init_empty_weights(include_buffers="
                          "False))")
    real: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for attr, p in list(module.named_parameters(recurse=False)):
            if not p.is_meta:
                continue
            if id(p) not in real:
                real[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device),
                                           requires_grad=p.requires_grad)
            setattr(module, attr, real[id(p)])


def _kind(entry: Any) -> str | None:
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict):
        return entry.get("kind")
    return getattr(entry, "kind", None)


def _quantize(model: nn.Module, cfg: InferenceConfig) -> None:
    """Quantize, then freeze what stays in full precision (Note [a quantized model is frozen])."""
    quantize_weights(model, bits=cfg.quant.bits, group_size=cfg.quant.group_size)
    for p in model.parameters():
        p.requires_grad_(False)


def _inject(model: nn.Module, cfg: InferenceConfig) -> int:
    """replace_with_kernel_inject: plain linear layers -> prepacked ones (inject.py); how
    many were replaced. Not under ZeRO-Inference, which gathers parameters the packed layers
    would no longer have."""
    if not cfg.replace_with_kernel_inject:
        return 0
    if cfg.zero.stage == 3:
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.warning("replace_with_kernel_inject has no effect with zero.stage 3: ZeRO-Inference "
                        "gathers each layer's parameters, which prepacked layers would replace")
        return 0
    return inject_kernels(model)


def _partition(model: nn.Module, cfg: InferenceConfig, topology: Any) -> Any:
    # The section as the user wrote it (a plain mapping), so zero_inference owns its defaults.
    section = {**cfg.zero.model_dump(exclude_unset=True), "stage": 3}
    return partition_for_inference(model, section, topology.group("dp"))


__all__ = ["DeepSpeedInferenceConfig", "InferenceEngine", "check_dtype_runs", "check_heads",
           "init_inference", "materialize_meta", "split_for_inference"]
