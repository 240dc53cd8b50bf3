"""DeepSpeed's compression API: `init_compression` before training, `redundancy_clean` after.

    model = init_compression(model, "ds_config.json")          # layers wrapped, masks made
    engine, *_ = meshspeed.initialize(model=model, config="ds_config.json")
    ...train: the engine steps the schedule after each optimizer step...
    model = redundancy_clean(model, "ds_config.json")          # written in; pruned units cut

Both read only the config's `compression_training` block (a path to a JSON file, a dict,
a `MeshspeedConfig` or a `CompressionConfig`). docs/compression.md has the whole story.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from meshspeed.compression import clean
from meshspeed.compression.helper import recursive_getattr, recursive_setattr
from meshspeed.compression.layer_reduction import student_initialization
from meshspeed.compression.layers import (
    WRAPPERS,
    ActivationQuant,
    Compressed,
    Phase,
    Prune,
    Technique,
    WeightQuant,
)
from meshspeed.compression.select import Selection, plan
from meshspeed.config.compression import CompressionConfig
from meshspeed.config.errors import ConfigError
from meshspeed.config.keys import check_keys
from meshspeed.config.loader import read_config
from meshspeed.config.root import MeshspeedConfig

__all__ = ["compression_config", "init_compression", "redundancy_clean"]

# the order redundancy_clean writes techniques in: DeepSpeed's (quantized values are taken
# over the whole weight before anything is cut out of it)
CLEAN_ORDER = ("weight_quantization", "sparse_pruning", "row_pruning", "head_pruning",
               "channel_pruning")


def compression_config(config: Any) -> CompressionConfig:
    """The typed `compression_training` block of a DeepSpeed config (path, dict, ...)."""
    if isinstance(config, CompressionConfig):
        return config
    if isinstance(config, MeshspeedConfig):
        return config.compression_training
    if not isinstance(config, (str, dict)) and not hasattr(config, "__fspath__"):
        raise ConfigError("deepspeed_config must be a path to a JSON file or a dict (got "
                          f"{type(config).__name__})")
    block = read_config(config).get("compression_training", {})
    if not isinstance(block, dict):
        raise ConfigError("compression_training: expected an object ({...})")
    # the key walk from the top gives full paths and did-you-mean for this block only
    checked = check_keys({"compression_training": block}, MeshspeedConfig)
    if checked.problems:
        raise ConfigError(checked.problems)
    return CompressionConfig.checked(checked.data["compression_training"], "compression_training")


def _unwrap_engine(model: nn.Module) -> nn.Module:
    inner = getattr(model, "module", None)  # an engine or DDP: DeepSpeed's `model.module`
    return inner if isinstance(inner, nn.Module) else model


def _no_mpu(mpu: Any) -> None:
    if mpu is not None:
        raise ValueError("mpu: meshspeed's compression wraps torch's Linear / Conv2d / Embedding "
                         "only, not a model-parallel library's layers; call it with mpu=None")


def init_compression(model: nn.Module, deepspeed_config: Any, teacher_model: nn.Module | None = None,
                     mpu: Any = None) -> nn.Module:
    """Wrap the layers the config names and give them their techniques; returns `model`.

    With `layer_reduction` enabled, `model` is the (shallower) student and its chosen layers
    are first copied from `teacher_model`. Techniques whose schedule_offset is 0 are on at
    once (DeepSpeed's step-0 check); the others start when the scheduler reaches them.
    """
    _no_mpu(mpu)
    cfg = compression_config(deepspeed_config)
    target = _unwrap_engine(model)
    if cfg.layer_reduction.enabled:
        if teacher_model is None:
            raise ValueError("compression_training.layer_reduction is enabled: init_compression "
                             "needs teacher_model=<the deeper model whose layers the student copies>")
        student_initialization(target, _unwrap_engine(teacher_model), cfg.layer_reduction)
    for selection in plan(target, cfg):
        for name in selection.modules:
            layer = recursive_getattr(target, name)
            if not isinstance(layer, Compressed):
                layer = WRAPPERS[type(layer)].wrap(layer)
                recursive_setattr(target, name, layer)
            layer.add(_technique(cfg, selection.technique, selection.group, layer, name))
    for module in target.modules():
        if isinstance(module, Compressed):
            module.at_step(0)
    return model


def _technique(cfg: CompressionConfig, technique: str, group: str, layer: nn.Module,
               name: str) -> Technique:
    section = getattr(cfg, technique)
    shared = section.shared_parameters
    params = section.different_groups[group].params
    where = f"compression_training.{technique}"
    if technique == "weight_quantization":
        groups = shared.quantize_groups
        if isinstance(layer, nn.Embedding) and shared.quantize_weight_in_forward:
            groups = layer.num_embeddings  # DeepSpeed: one scale per token, whatever the config
        elif layer.weight.numel() % groups:
            raise ConfigError(f"{where}.shared_parameters.quantize_groups: {groups} does not divide "
                              f"the {layer.weight.numel()} weights of {name}; use a divisor")
        mixed = shared.fp16_mixed_quantize
        return WeightQuant(technique, shared.schedule_offset, start_bits=params.start_bits,
                           target_bits=params.target_bits, period=params.quantization_period,
                           groups=groups, symmetric=shared.quantization_type == "symmetric",
                           stochastic=shared.rounding == "stochastic",
                           in_forward=shared.quantize_weight_in_forward,
                           change=mixed.quantize_change_ratio if mixed.enabled else None,
                           verbose=shared.quantize_verbose)
    if technique == "activation_quantization":
        return ActivationQuant(technique, shared.schedule_offset, bits=params.bits,
                               symmetric=shared.quantization_type == "symmetric",
                               static=shared.range_calibration == "static")
    heads = getattr(shared, "num_heads", None)
    if heads is not None and layer.in_features % heads:
        raise ConfigError(f"{where}.shared_parameters.num_heads: {name} has {layer.in_features} "
                          f"inputs, which do not split into {heads} heads; modules of head_pruning "
                          "are attention output matrices")
    return Prune(technique, shared.schedule_offset, method=shared.method,
                 dense_ratio=params.dense_ratio, num_heads=heads)


def redundancy_clean(model: nn.Module, deepspeed_config: Any, mpu: Any = None) -> nn.Module:
    """Write every technique into the weights and cut what pruning removed; returns `model`.

    Afterwards the model computes what the compressed model computed in eval mode with every
    technique on (weight quantization at the bits it had reached), with plain torch layers
    (a layer keeps its wrapper only for activation quantization, which happens at run time),
    and pruned rows / heads / channels whose group names related layers are gone from the
    tensors. Call it with the config given to `init_compression`.
    """
    _no_mpu(mpu)
    cfg = compression_config(deepspeed_config)
    target = _unwrap_engine(model)
    selections = [s for s in plan(target, cfg) if s.technique in CLEAN_ORDER]
    for selection in sorted(selections, key=lambda s: CLEAN_ORDER.index(s.technique)):
        _clean(target, selection)
    for name, module in list(target.named_modules()):
        if isinstance(module, Compressed) and all(t.phase is Phase.FIXED
                                                  for t in module.compression.values()):
            recursive_setattr(target, name, module.unwrap())
    return model


def _clean(model: nn.Module, selection: Selection) -> None:
    technique = selection.technique
    keeps = []
    for name in selection.modules:
        layer = recursive_getattr(model, name)
        state = layer.compression.get(technique) if isinstance(layer, Compressed) else None
        if state is None or state.phase is Phase.FIXED:
            raise ConfigError(f"compression_training.{technique}: {name} has no {technique} to "
                              "clean up; call redundancy_clean once, on the model init_compression "
                              "prepared with this config")
        if technique == "weight_quantization":
            clean.fix_weight_quantization(layer)
        elif technique == "sparse_pruning":
            clean.fix_sparse(layer)
        else:
            keeps.append(clean.fix_structured(layer, technique, cut=bool(selection.related)))
    for names in selection.related:
        for name, keep in zip(names, keeps):
            clean.cut_related(recursive_getattr(model, name), technique, keep, name)
