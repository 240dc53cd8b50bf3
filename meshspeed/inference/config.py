"""`init_inference`'s config: DeepSpeed's inference keys, typed, from a dict, a JSON file,
keyword arguments, or a dict and keyword arguments together.

Owned by `meshspeed/inference/engine.py`. `DeepSpeedInferenceConfig` is the same class
under DeepSpeed's name, so `deepspeed.inference.config.DeepSpeedInferenceConfig` resolves
through meshspeed's alias.

Note [merging config and keyword arguments]
DeepSpeed lets `init_inference(model, config=..., **kwargs)` give settings both ways. Each
source is first put in canonical form (old spellings renamed: `mp_size` ->
`tensor_parallel.tp_size`, `max_tokens` -> `max_out_tokens`, `tp` -> `tensor_parallel`;
dtypes to "fp32"/"fp16"/"bf16"), then the two are merged key by key. The same key with
two different values is an error naming the key and both values: silently preferring one
would run a layout or precision the user did not ask for in one of the two places.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, model_validator

from meshspeed.config.base import NonNegInt, PositiveInt, StrictModel, closest
from meshspeed.config.errors import ConfigError, show
from meshspeed.config.keys import submodel
from meshspeed.config.offload import OffloadParamConfig
from meshspeed.offload.swapdir import check_nvme_path

logger = logging.getLogger("meshspeed")

# Every spelling of a dtype DeepSpeed scripts use -> meshspeed's name for it.
_DTYPES: dict[Any, str] = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32", "torch.float": "fp32",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16", "torch.half": "fp16",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
}
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def canonical_dtype(value: Any) -> Any:
    """"fp32" / "fp16" / "bf16" for any accepted spelling; anything else unchanged (the
    field's validation then names it)."""
    if isinstance(value, (torch.dtype, str)):
        key = value.lower() if isinstance(value, str) else value
        if key in ("int8", torch.int8, "torch.int8"):
            raise ConfigError("dtype: int8 is weight quantization in meshspeed, not a compute "
                              'dtype; give quant={"enabled": true, "bits": 8} and a float dtype')
        return _DTYPES.get(key, value)
    return value


class TPConfig(StrictModel):
    """DeepSpeed's `tensor_parallel` block."""

    enabled: bool = True  # False: tp_size is ignored and the model stays whole
    tp_size: PositiveInt = 1  # ranks each weight matrix is split over
    tp_grain_size: PositiveInt = 1  # no effect: meshspeed splits whole heads evenly
    # DeepSpeed's ways to hand in a group of one's own; meshspeed builds it from the world
    tp_group: Any = None
    mpu: Any = None

    @model_validator(mode="after")
    def _no_own_group(self):
        for key in ("tp_group", "mpu"):
            if getattr(self, key) is not None:
                raise ValueError(f"{key}: a process group of one's own is not supported; meshspeed "
                                 "builds the tensor-parallel group from the world (give tp_size only)")
        return self


class QuantConfig(StrictModel):
    """Weight-only quantization applied at load (meshspeed/inference/quant.py)."""

    enabled: bool = False
    bits: Literal[8, 4] = 8  # INT8 or INT4 weights
    group_size: PositiveInt | None = None  # None: one scale per output channel


_ZERO_KEYS = ("stage", "offload_param", "prefetch_layers")
_OFFLOAD_KEYS = ("device", "nvme_path", "pin_memory")
# DeepSpeed's offload_param tuning keys for training's swapper: nothing to tune here
_OFFLOAD_IGNORED = ("buffer_count", "buffer_size", "max_in_cpu")
_DEVICES = ("none", "cpu", "nvme")


class ZeroInferenceConfig(StrictModel):
    """ZeRO-Inference: weights partitioned over ranks (or offloaded) and gathered layer by
    layer (meshspeed/inference/zero_inference.py). Only stage 3 partitions weights; stages
    1 and 2 partition optimizer state and gradients, which inference has none of."""

    stage: Literal[0, 3] = 0
    offload_param: OffloadParamConfig | None = None
    prefetch_layers: NonNegInt = 1  # units gathered ahead of the running one

    @property
    def device(self) -> str:
        """Where shards live: "none" (the compute device), "cpu" or "nvme"."""
        return self.offload_param.device if self.offload_param is not None else "none"

    @property
    def nvme_path(self) -> str | None:
        return self.offload_param.nvme_path if self.offload_param is not None else None

    @property
    def pin_memory(self) -> bool:
        return self.offload_param is not None and self.offload_param.pin_memory

    @classmethod
    def from_dict(cls, section: Any) -> ZeroInferenceConfig:
        """The `zero` section as `partition_for_inference` takes it: stage 3 required, one
        sentence per mistake."""
        if not isinstance(section, dict):
            raise ConfigError(f"zero: expected an object ({{...}}), got {show(section)}")
        _reject_unknown(section, _ZERO_KEYS, "zero")
        if "stage" not in section:
            raise ConfigError('zero.stage: is required; ZeRO-Inference is stage 3 (write "stage": 3)')
        if section["stage"] != 3 or isinstance(section["stage"], bool):
            raise ConfigError(f"zero.stage: ZeRO-Inference partitions weights, which is stage 3 "
                              f"(got {show(section['stage'])}); write \"stage\": 3")
        offload = section.get("offload_param") or {}
        if not isinstance(offload, dict):
            raise ConfigError(f"zero.offload_param: expected an object ({{...}}), got {show(offload)}")
        offload = {k: v for k, v in offload.items() if k not in _OFFLOAD_IGNORED}
        _reject_unknown(offload, _OFFLOAD_KEYS, "zero.offload_param")
        device = offload.get("device", "none")
        if device not in _DEVICES:
            raise ConfigError(f"zero.offload_param.device: must be one of "
                              f"{', '.join(map(show, _DEVICES))} (got {show(device)})")
        if not isinstance(offload.get("pin_memory", False), bool):
            raise ConfigError(f"zero.offload_param.pin_memory: expected true or false (got "
                              f"{show(offload['pin_memory'])})")
        prefetch = section.get("prefetch_layers", 1)
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
            raise ConfigError(f"zero.prefetch_layers: expected a whole number >= 0 (got {show(prefetch)})")
        if device == "nvme":
            check_nvme_path(offload.get("nvme_path"), "zero.offload_param.nvme_path")
        return cls.checked({"stage": 3, "offload_param": offload, "prefetch_layers": prefetch}, "zero.")


def _reject_unknown(section: dict, known: tuple[str, ...], where: str) -> None:
    for key in section:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"{where}.{key}: unknown key; {hint}the keys are {', '.join(known)}")


class InferenceConfig(StrictModel):
    """Every key `init_inference` takes (DeepSpeed's names)."""

    key_aliases: ClassVar[dict[str, str]] = {
        "tp": "tensor_parallel", "max_tokens": "max_out_tokens", "min_tokens": "min_out_tokens",
        "kernel_inject": "replace_with_kernel_inject", "tm": "triangular_masking",
        "injection_dict": "injection_policy", "ckpt_config": "checkpoint_config"}

    tensor_parallel: TPConfig = Field(default_factory=TPConfig)
    dtype: Literal["fp32", "fp16", "bf16"] = "fp32"
    # linear layers replaced by prepacked ones where the device has them (inject.py; not
    # bit-identical to the plain layers: rounding differs)
    replace_with_kernel_inject: bool = False
    max_out_tokens: PositiveInt = 1024  # longest prompt + generated tokens engine.generate runs
    quant: QuantConfig = Field(default_factory=QuantConfig)
    checkpoint: str | None = None  # meshspeed checkpoint dir, safetensors file or HF-style dir
    base_dir: str = ""  # a relative `checkpoint` is found under this directory
    zero: ZeroInferenceConfig = Field(default_factory=ZeroInferenceConfig)
    # DeepSpeed keys with no effect here (NO_EFFECT says why); checked, then logged once.
    min_out_tokens: PositiveInt = 1
    enable_cuda_graph: bool = False
    use_triton: bool = False
    triton_autotune: bool = False
    triangular_masking: bool = True
    return_tuple: bool = True
    injection_policy: Any = None
    injection_policy_tuple: Any = None
    replace_method: str = "auto"
    transposed_mode: bool = False
    keep_module_on_host: bool = False
    set_empty_params: bool = False
    training_mp_size: PositiveInt = 1
    checkpoint_config: Any = None
    # DeepSpeed keys for features meshspeed does not have: a non-default value is an error.
    save_mp_checkpoint_path: str | None = None
    ep_size: PositiveInt = 1

    @model_validator(mode="after")
    def _refuse_missing_features(self):
        if self.save_mp_checkpoint_path is not None:
            raise ValueError("save_mp_checkpoint_path: meshspeed does not write tensor-parallel "
                             "inference checkpoints; save with engine.save_checkpoint in training "
                             "or save_pretrained, and load either with checkpoint=...")
        if self.ep_size > 1:
            raise ValueError(f"ep_size {self.ep_size}: expert parallelism is not part of meshspeed "
                             "inference; remove the key (experts stay whole on each rank)")
        if self.quant.enabled and self.zero.stage == 3:
            raise ValueError("quant.enabled with zero.stage 3: partitioned quantized weights are "
                             "not supported; choose one of the two")
        return self

    @property
    def tp_size(self) -> int:
        return self.tensor_parallel.tp_size if self.tensor_parallel.enabled else 1

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]


DeepSpeedInferenceConfig = InferenceConfig  # DeepSpeed's name (compat alias)

# dotted key -> why it changes nothing in meshspeed
NO_EFFECT: dict[str, str] = {
    "min_out_tokens": "generation stops at max_new_tokens or a stop token",
    "enable_cuda_graph": "no CUDA graphs are captured",
    "use_triton": "kernels come from meshspeed's registry (kernels.py)",
    "triton_autotune": "kernels come from meshspeed's registry (kernels.py)",
    "triangular_masking": "the model's own causal mask is used",
    "return_tuple": "the model's own return type is kept",
    "injection_policy": "tensor parallelism uses the automatic or the model's own plan",
    "injection_policy_tuple": "tensor parallelism uses the automatic or the model's own plan",
    "replace_method": "tensor parallelism uses the automatic or the model's own plan",
    "transposed_mode": "weights keep their layout",
    "keep_module_on_host": "the model stays where it is",
    "set_empty_params": "parameters are loaded in place",
    "training_mp_size": "checkpoints hold whole logical parameters, loadable at any tp size",
    "checkpoint_config": "give the checkpoint path as checkpoint=...",
    "tensor_parallel.tp_grain_size": "heads are split evenly",
}

_LEGACY = {"mp_size": ("tensor_parallel", "tp_size")}  # DeepSpeed's old top-level keys


def load_inference_config(config: Any = None, **kwargs: Any) -> InferenceConfig:
    """The typed config from `config` (None, a dict, a JSON file path, or an
    InferenceConfig) and keyword arguments (Note [merging config and keyword arguments])."""
    if isinstance(config, InferenceConfig):
        config = config.model_dump(exclude_unset=True)
    elif isinstance(config, (str, os.PathLike)):
        config = _read_json(os.fspath(config))
    elif config is None:
        config = {}
    elif not isinstance(config, dict):
        raise ConfigError(f"config must be a dict, a JSON file path or None, got "
                          f"{type(config).__name__}")
    problems: list[str] = []
    merged = _merge(_canonical(config, InferenceConfig, "", problems),
                    _canonical(kwargs, InferenceConfig, "", problems), "", problems)
    if problems:
        raise ConfigError(problems)
    return InferenceConfig.checked(merged)


def report_no_effect(cfg: InferenceConfig, rank: int = 0) -> list[str]:
    """The no-effect keys set to other than their default; logged once on rank 0."""
    notes = []
    for path, why in NO_EFFECT.items():
        node, *rest = path.split(".")
        owner, leaf = (cfg, node) if not rest else (getattr(cfg, node), rest[0])
        if leaf in owner.model_fields_set and getattr(owner, leaf) != type(owner).model_fields[leaf].default:
            notes.append(f"{path}={getattr(owner, leaf)!r} ({why})")
    if notes and rank == 0:
        logger.warning("init_inference keys with no effect in meshspeed: %s", "; ".join(notes))
    return notes


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as err:
        raise ConfigError(f"config file {path} cannot be read ({err.strerror}); pass a dict or "
                          "the path of a JSON file") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"config file {path} is not JSON: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} holds a {type(data).__name__}, not a JSON object")
    return data


def _canonical(raw: dict, model: type[StrictModel], path: str, problems: list[str]) -> dict:
    """`raw` with aliases renamed, legacy keys moved, dtypes canonical; unknown keys
    reported (with the closest valid key)."""
    out: dict[str, Any] = {}
    fields = model.model_fields
    for key, value in raw.items():
        full = f"{path}.{key}" if path else str(key)
        if not path and key in _LEGACY:
            section, leaf = _LEGACY[key]
            sub = {leaf: value}
            out[section] = _merge(out.get(section, {}), sub, section, problems)
            continue
        name = model.key_aliases.get(key, key)
        if name not in fields:
            here = sorted(set(fields) | set(model.key_aliases) | (set(_LEGACY) if not path else set()))
            guess = closest(str(key), here) or _prefix_match(str(key), here)
            hint = f"did you mean '{guess}'?" if guess else f"valid keys here: {', '.join(here)}"
            problems.append(f"{full}: unknown init_inference key; {hint}")
            continue
        sub = _submodel(fields[name].annotation)
        if name == "dtype":
            try:
                value = canonical_dtype(value)
            except ConfigError as err:
                problems.extend(err.problems)
                continue
        elif name in ("checkpoint", "base_dir") and isinstance(value, os.PathLike):
            value = os.fspath(value)
        elif sub is not None and isinstance(value, dict):
            value = _canonical(value, sub, f"{path}.{name}" if path else name, problems)
        here_path = f"{path}.{name}" if path else name
        out[name] = _merge(out[name], value, here_path, problems) if name in out else value
    return out


def _prefix_match(key: str, candidates: list[str]) -> str | None:
    """A valid key that starts the given one or is started by it ("quantization" ->
    "quant"), which difflib's ratio misses when the lengths differ much."""
    hits = [c for c in candidates if min(len(c), len(key)) >= 4 and (key.startswith(c) or c.startswith(key))]
    return max(hits, key=len) if hits else None


def _submodel(annotation: Any) -> type[StrictModel] | None:
    return submodel(annotation)


def _merge(a: Any, b: Any, path: str, problems: list[str]) -> Any:
    """`a` and `b` merged key by key; a leaf given twice with different values is reported."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = dict(a)
        for k, v in b.items():
            out[k] = _merge(a[k], v, f"{path}.{k}" if path else k, problems) if k in a else v
        return out
    if a != b or type(a) is not type(b):
        if a == b and isinstance(a, (int, float)) and not isinstance(a, bool) and not isinstance(b, bool):
            return a  # 2 and 2.0 are one value
        problems.append(f"{path}: given twice with different values, {show(a)} and {show(b)}; "
                        "give it once (in config or as a keyword argument)")
    return a


__all__ = ["DeepSpeedInferenceConfig", "InferenceConfig", "QuantConfig", "TPConfig",
           "ZeroInferenceConfig", "canonical_dtype", "load_inference_config", "report_no_effect"]
