"""What an accepted-but-unused DeepSpeed key means for the run, by what it asks for.

`known_keys.ACCEPTED_UNUSED` lists the DeepSpeed keys meshspeed parses but has no feature
behind yet. Going on without the feature is only honest when the user loses nothing but
a report or a tuning knob, so each key is judged by its value:

* a value that asks for a parallelism or for different numerics (ZeRO++ hierarchical
  partitioning, `amp`, ...) is a
  ConfigError: training on would silently be plain data parallelism, or other numbers;
* a monitor or logger that is switched on (`comet`, `timers`, `eigenvalue`, ...)
  is one warning on rank 0 saying it is not there;
* anything else (tuning knobs of DeepSpeed's own implementation) is one notice on rank 0.

A value that asks for nothing (`enabled: false`, a size of 1, false, a block whose parent
is disabled such as `fp16.fused_mode` with fp16 off) is not reported at all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def _enabled(value: Any) -> bool:
    """True if `value`, or any block inside it, says `"enabled": true` (or is `true`)."""
    if value is True:
        return True
    if isinstance(value, dict):
        if value.get("enabled") is True:
            return True
        return any(_enabled(v) for k, v in value.items() if k != "enabled" and isinstance(v, dict))
    return False


def _above(limit: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > limit


def _truthy(value: Any) -> bool:
    return bool(value)


def _grad_accum_dtype(value: Any) -> bool:
    dtype = value.get("grad_accum_dtype") if isinstance(value, dict) else None
    return dtype not in (None, "fp32", "float32", "torch.float32")


# path -> (does the value ask for it?, what it asks for)
ASKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "expert_parallel": (_enabled, "expert parallelism"),
    "weight_quantization": (_enabled, "weight quantization"),
    "quantize_training": (_enabled, "quantization-aware training"),
    "sparse_attention": (_truthy, "sparse attention"),
    "sparse_gradients": (_truthy, "sparse gradients"),
    "progressive_layer_drop": (_enabled, "progressive layer dropping"),
    "curriculum_learning": (_enabled, "curriculum learning"),
    "data_efficiency": (_enabled, "data efficiency (curriculum / random layer token drop)"),
    "elasticity": (_enabled, "elastic batch sizes"),
    "hybrid_engine": (_enabled, "the hybrid (RLHF) engine"),
    "amp": (_enabled, "NVIDIA Apex AMP numerics"),
    "torch_autocast": (_enabled, "torch.autocast numerics"),
    "data_types": (_grad_accum_dtype, "a gradient accumulation dtype other than fp32"),
    "fp16.fp16_master_weights_and_grads": (_truthy, "fp16 master weights and gradients"),
    "bf16.bf16_master_weights_and_grads": (_truthy, "bf16 master weights and gradients"),
    "bf16.bf16_optimizer_states": (_truthy, "bf16 optimizer states"),
    "zero_optimization.zero_quantized_nontrainable_weights": (
        _truthy, "ZeRO++ non-trainable weights stored quantized"),
    "zero_optimization.zeropp_loco_param": (_truthy, "ZeRO++ LoCo gradient compression"),
    "zero_optimization.mics_shard_size": (_above(0), "MiCS sharding"),
    "zero_optimization.zenflow": (_truthy, "ZenFlow"),
}

# monitors and loggers: path -> what to use instead
MONITORS: dict[str, str] = {
    "comet": "your own logging",
    "timers": "torch.profiler",
    "memory_breakdown": "engine.memory_breakdown()",
    "nebula": "checkpoint.async_save",
    "eigenvalue": "nothing yet",
}


@dataclass
class Unbuilt:
    problems: list[str] = field(default_factory=list)  # ConfigError lines
    monitors: list[str] = field(default_factory=list)  # one warning on rank 0
    notes: list[str] = field(default_factory=list)  # one notice on rank 0 (dotted paths)


def _disabled(value: Any) -> bool:
    return value is False or value is None or (isinstance(value, dict) and value.get("enabled") is False)


def _parent_disabled(path: str, raw: dict[str, Any]) -> bool:
    node: Any = raw
    for name in path.split(".")[:-1]:
        node = node.get(name) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get("enabled") is False:
            return True
    return False


def classify(unused: dict[str, Any], raw: dict[str, Any]) -> Unbuilt:
    """Judge each accepted-but-unused key (dotted path -> the value given)."""
    out = Unbuilt()
    for path, value in unused.items():
        if _parent_disabled(path, raw):
            continue
        if path in ASKS:
            asks, what = ASKS[path]
            if asks(value):
                out.problems.append(f"{path}: asks for {what}, which meshspeed does not implement "
                                    "yet; remove the key (or set it to its default) to train without it")
            continue
        if path in MONITORS:
            if _enabled(value) or (value is not None and not isinstance(value, (dict, bool))):
                out.monitors.append(f"{path} (meshspeed has none yet; use {MONITORS[path]})")
            continue
        if not _disabled(value):
            out.notes.append(path)
    out.problems.extend(_summed_gradients_with(raw.get("gradient_allreduce_op"), unused))
    return out


# keys DeepSpeed refuses next to gradient_allreduce_op "sum": path -> what it asks for
_NOT_WITH_SUM = {"zero_optimization.zenflow": ("ZenFlow", "zero_optimization.zenflow"),
                 "compile": ("DeepCompile", "compile.deepcompile")}


def _summed_gradients_with(op: Any, unused: dict[str, Any]) -> list[str]:
    """DeepSpeed's verdict on summed gradients next to features meshspeed sets aside. (meshspeed
    refuses "sum" when it builds an engine; this names the conflict when the config is read.)"""
    if not (isinstance(op, str) and op.lower() == "sum"):
        return []
    given = dict(unused)
    compile_block = given.get("compile")
    if not (isinstance(compile_block, dict) and compile_block.get("deepcompile")):
        given.pop("compile", None)
    return [f'gradient_allreduce_op "sum" is not supported with {what} ({key}); use "mean"'
            for path, (what, key) in _NOT_WITH_SUM.items() if given.get(path) is not None]
