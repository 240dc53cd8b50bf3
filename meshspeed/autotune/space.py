"""The layouts worth measuring: the planner's ranking for this machine, cut to what the
script can run, each turned into a trial config (the user's config + the layout's keys)."""

from __future__ import annotations

import copy
import os
import random
from typing import Any

import torch

from meshspeed.config import MeshspeedConfig
from meshspeed.planner import Choice, plan

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def machine_memory(nproc: int) -> float:
    """Bytes one rank may use: the device's memory, or on CPU the machine's available RAM
    shared by the ranks."""
    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory)
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    except (OSError, StopIteration):
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return avail / nproc


def _machine_kwargs() -> dict[str, Any]:
    # Only the order of the candidates matters here (the trials measure the rest). On CPU
    # the figures are rough: ~60 GFLOP/s reached per rank (the reference GPT measured
    # 205-245 ms per 16 x 256-token step on 2 ranks of a 2-core machine), gloo over
    # shared memory.
    if torch.cuda.is_available():
        return {}
    return {"peak_flops": 1.2e11, "mfu": 0.5, "layer_overhead": 1e-3,
            "link": "intra=2GB/s,inter=1GB/s", "latency": {"intra": 5e-5, "inter": 1e-4}}


def degrees(parsed: MeshspeedConfig) -> dict[str, int]:
    """The model-parallel degrees the user's config fixes (autotuning.mp_size when it
    gives no tensor_parallel size); the tuner keeps them."""
    tp = parsed.tensor_parallel.size if parsed.tensor_parallel.size > 1 else (parsed.autotuning.mp_size or 1)
    pp = parsed.pipeline.stages if isinstance(parsed.pipeline.stages, int) else 1
    return {"tp": tp, "pp": pp, "cp": parsed.sequence.size, "ep": 1}


def rank_layouts(model: dict[str, Any], parsed: MeshspeedConfig, *, nproc: int,
                 global_batch: int, seq_len: int, precision: str, top_k: int, seed: int = 0) -> list[Choice]:
    """The top_k layouts to try, best predicted first: the parallel degrees stay the
    user's (tp/pp/cp only when the config already asks for them); ZeRO stage, micro-batch
    and accumulation vary, offload only on a GPU, activation checkpointing only when the
    config has an activation_checkpointing block (the script then checkpoints its blocks)."""
    tune = parsed.autotuning
    fixed = degrees(parsed)
    p = plan(model, nproc, machine_memory(nproc), global_batch=global_batch, seq_len=seq_len,
             precision=precision, gpus_per_node=nproc,
             offloads=(None, "cpu") if torch.cuda.is_available() else (None,),
             checkpointing=(False, True) if "activation_checkpointing" in parsed.model_fields_set else (False,),
             **_machine_kwargs())
    lo, hi = tune.min_train_micro_batch_size_per_gpu, tune.max_train_micro_batch_size_per_gpu
    ranked = [ch for ch in p.candidates
              if all(getattr(ch.candidate, k) == v for k, v in fixed.items())
              and lo <= ch.candidate.micro_batch <= hi]
    if tune.tuner_type == "random":
        random.Random(seed).shuffle(ranked)
    chosen, micro_sizes, seen = [], [], set()
    for ch in ranked:
        mb = ch.candidate.micro_batch
        if mb not in micro_sizes:
            if len(micro_sizes) >= tune.num_tuning_micro_batch_sizes:
                continue
            micro_sizes.append(mb)
        key = repr(layout_keys(ch))
        if key not in seen:
            seen.add(key)
            chosen.append(ch)
        if len(chosen) == top_k:
            break
    return chosen


def layout_keys(choice: Choice) -> dict[str, Any]:
    """The config keys a layout sets (batch triad, ZeRO stage, offload, checkpointing)."""
    c = choice.candidate
    keys: dict[str, Any] = {"train_batch_size": choice.plan.global_batch,
                            "train_micro_batch_size_per_gpu": c.micro_batch,
                            "gradient_accumulation_steps": c.grad_accum,
                            "zero_optimization.stage": c.stage,
                            "zero_optimization.offload_optimizer.device": c.offload}
    keys["activation_checkpointing"] = c.checkpointing
    return keys


def trial_config(user: dict[str, Any], keys: dict[str, Any]) -> dict[str, Any]:
    """The user's config with a layout's keys set: what the trial runs and what
    best_config.json holds. The autotuning block is dropped (a trial must not tune)."""
    cfg = copy.deepcopy(user)
    cfg.pop("autotuning", None)
    for k in BATCH_KEYS:
        cfg[k] = keys[k]
    zero = dict(cfg.get("zero_optimization") or {})
    zero["stage"] = keys["zero_optimization.stage"]
    device = keys["zero_optimization.offload_optimizer.device"]
    if device:
        zero["offload_optimizer"] = {**(zero.get("offload_optimizer") or {}), "device": device}
    else:
        zero.pop("offload_optimizer", None)
    cfg["zero_optimization"] = zero
    if "activation_checkpointing" in user and not keys["activation_checkpointing"]:
        cfg.pop("activation_checkpointing")
    return cfg


def probe_config(user: dict[str, Any]) -> dict[str, Any]:
    """A config one process surely runs: one sample, no sharding, no offload."""
    cfg = copy.deepcopy(user)
    cfg.pop("autotuning", None)
    for k in BATCH_KEYS:
        cfg[k] = 1
    cfg["zero_optimization"] = {"stage": 0}
    for k in ("tensor_parallel", "pipeline", "sequence_parallel_size", "context_parallel"):
        cfg.pop(k, None)
    return cfg
