"""Optimizers from the DeepSpeed-format config, built over the strategy's master tensors.

Note [Adam means AdamW]
DeepSpeed's `"type": "Adam"` applies decoupled weight decay unless `adam_w_mode` is false,
so a config ported from DeepSpeed keeps its meaning: Adam + adam_w_mode (default true) is
torch's AdamW; Adam + adam_w_mode false is torch's Adam (L2 penalty in the gradient).

Note [no weight_decay means 0]
A config that names no `weight_decay` trains without weight decay in DeepSpeed, for "Adam"
and "AdamW" alike: both become its FusedAdam (or DeepSpeedCPUAdam when offloaded), whose
default is 0 (DeepSpeed 0.19.8, engine `_configure_basic_optimizer` and
`get_optimizer_configuration`). torch's AdamW defaults to 0.01, so building torch.optim.AdamW
from such a config without saying 0 shrinks every weight by lr * 0.01 each step that DeepSpeed
does not (the DeepSpeedExamples pipeline example, whose config is Adam lr 1e-3 and no decay,
moved off DeepSpeed's losses from the second step: benchmarks/pipeline_example_drift.py).
Only `"torch_adam": true` makes DeepSpeed build torch's class from the params as written,
and then torch's default applies (AdamW 0.01, Adam 0); meshspeed does the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from difflib import get_close_matches
from typing import Any

import torch
from torch import nn

from meshspeed.optim.adam import FusedAdam
from meshspeed.optim.onebit import OneBitAdam
from meshspeed.optim.onebit_lamb import OneBitLamb
from meshspeed.optim.zero_one import ZeroOneAdam

_COMMON = {"lr", "weight_decay"}
_ALLOWED = {
    "Adam": _COMMON | {"betas", "eps", "amsgrad", "adam_w_mode", "torch_adam", "bias_correction", "fused", "foreach"},
    "AdamW": _COMMON | {"betas", "eps", "amsgrad", "torch_adam", "bias_correction", "fused", "foreach"},
    "SGD": _COMMON | {"momentum", "dampening", "nesterov", "foreach"},
    # DeepSpeed's OnebitAdam / ZeroOneAdam / OnebitLamb params (optim/onebit.py, zero_one.py,
    # onebit_lamb.py); max_grad_norm, eps_inside_sqrt
    # and amsgrad have no effect or are refused there, so they are not accepted here
    "OneBitAdam": _COMMON | {"betas", "eps", "freeze_step", "bias_correction", "cuda_aware",
                             "comm_backend_name", "bias_corrected_freeze"},  # the last: meshspeed's
    "ZeroOneAdam": _COMMON | {"betas", "eps", "bias_correction", "var_freeze_step", "var_update_scaler",
                              "local_step_scaler", "local_step_clipper", "cuda_aware", "comm_backend_name"},
    "OneBitLamb": _COMMON | {"betas", "eps", "freeze_step", "bias_correction", "max_coeff", "min_coeff",
                             "coeff_beta", "factor_max", "factor_min", "factor_threshold", "cuda_aware",
                             "comm_backend_name"},
}
_IGNORED = {"torch_adam", "bias_correction", "adam_w_mode"}  # DeepSpeed switches with no torch twin
# (torch_adam still decides the default weight decay: Note [no weight_decay means 0])


_NUMBERS = {"lr", "weight_decay", "eps", "momentum", "dampening"}


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _check_params(kind: str, params: dict[str, Any]) -> None:
    for key, value in params.items():
        if key not in _ALLOWED[kind]:
            hint = get_close_matches(key, sorted(_ALLOWED[kind]), n=1)
            extra = f"; did you mean '{hint[0]}'?" if hint else f"; allowed: {sorted(_ALLOWED[kind])}"
            raise ValueError(f"optimizer.params.{key}: unknown parameter for {kind}{extra}")
        if key in _NUMBERS and not _is_number(value):
            raise ValueError(f"optimizer.params.{key}: expected a number, got {value!r} "
                             f"({type(value).__name__}); write it without quotes, e.g. 1e-3")
        if key == "betas" and not (isinstance(value, list | tuple) and len(value) == 2
                                   and all(_is_number(b) for b in value)):
            raise ValueError(f"optimizer.params.betas: expected two numbers, e.g. [0.9, 0.999]; got {value!r}")


def build_optimizer(kind: str, params: dict[str, Any], groups: list[dict],
                    dp_group: Any = None) -> torch.optim.Optimizer:
    """`kind` in Adam / AdamW / SGD / OneBitAdam / ZeroOneAdam / OneBitLamb (canonical
    spelling); `params` the config's params block; `dp_group` the ranks an optimizer that
    communicates by itself (the last three) averages over."""
    _check_params(kind, params)
    if kind == "OneBitAdam":
        return OneBitAdam(groups, **params, group=dp_group)
    if kind == "ZeroOneAdam":
        return ZeroOneAdam(groups, **params, group=dp_group)
    if kind == "OneBitLamb":
        return OneBitLamb(groups, **params, group=dp_group)
    kwargs = {k: v for k, v in params.items() if k not in _IGNORED}
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    if kind == "SGD":
        return torch.optim.SGD(groups, **kwargs)
    decoupled = kind == "AdamW" or params.get("adam_w_mode", True)
    if not params.get("torch_adam", False):  # Note [no weight_decay means 0]
        kwargs.setdefault("weight_decay", 0.0)
        if not ({"fused", "foreach"} & kwargs.keys()) and not kwargs.get("amsgrad", False):
            # DeepSpeed's own class, as DeepSpeed builds it (Note [Adam means AdamW]); the
            # arithmetic is torch's fused Adam either way
            return FusedAdam(groups, adam_w_mode=bool(decoupled), **kwargs)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    if "fused" not in kwargs and "foreach" not in kwargs and _fusable(groups):
        # torch picks its slow per-tensor loop for CPU tensors; its fused kernel runs the
        # whole update in one pass over memory (about 2.5x faster here, same arithmetic)
        kwargs["fused"] = True
    return cls(groups, **kwargs)


def _fusable(groups: list[dict]) -> bool:
    params = [p for g in groups for p in g["params"]]
    return bool(params) and all(
        p.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
        and p.device.type in ("cpu", "cuda") for p in params)


# Note [model_parameters by name]
# Users list the parameters to train before initialize: a generator, a filtered list,
# `filter(...)`, or param-group dicts (weight-decay groups, as Hugging Face and
# DeepSpeed-Chat build them), or an optimizer built on them. Several axes then replace the
# model's parameters: tensor parallelism swaps a split layer's Parameters for its shards,
# a PipelineModule may rebuild its stage at initialize, zero.Init's placeholders are
# rebuilt into units. So the selection is recorded by the parameters' names in the model
# before anything is applied (`ParamSelection.capture`) and resolved against the model's
# parameters afterwards (`groups`): names do not change under any axis (tp keeps each
# layer's `weight` / `bias`, a pipeline stage registers layers under their global index).
# A selection that named every trainable parameter means "the whole model", and resolves
# to every trainable parameter of the rewritten module; a narrower selection keeps exactly
# its names (a name whose layer left this stage is dropped). A tensor that is no parameter
# of the model is an error.
#
# A pipeline rebind (an interleaved schedule from the config, Note [the mesh binds the
# stage]) places layers on a stage whose rank never saw them when the user listed its
# parameters: the user's rule for them (which group, whether trained, whether frozen) was
# applied on the rank that built them first. So the pipeline's ranks exchange their
# selections (`named`, then `joined`): a name this rank's user did not place takes the
# group another rank's user put it in (the local group with the same options; a new one
# if there is none); a parameter frozen (requires_grad False) where it was first built is
# frozen again where the rebind built it anew (`keep_frozen`); and "the whole model" holds
# only if every rank's selection named all of its stage. A weight-decay split, a frozen
# embedding or a fine-tune of some layers then means on the new stage what it meant on
# the first one.

Groups = list[tuple[dict, list[str]]]  # (options, parameter names) per param group


class ParamSelection:
    """The user's parameter groups by parameter name (Note [model_parameters by name])."""

    def __init__(self, groups: Groups, whole: bool, frozen: frozenset[str] = frozenset()):
        self._groups, self.whole, self.frozen = groups, whole, frozen

    @classmethod
    def capture(cls, model_parameters: Iterable | None, module: nn.Module) -> ParamSelection:
        names = {id(p): n for n, p in module.named_parameters()}
        frozen = frozenset(n for n, p in module.named_parameters() if not p.requires_grad)
        if model_parameters is None:
            return cls([({}, [n for n, p in module.named_parameters() if p.requires_grad])], True, frozen)
        source = list(model_parameters)
        raw = source if source and isinstance(source[0], dict) else [{"params": source}]
        groups = []
        for group in raw:
            params = group["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            unknown = [p for p in params if id(p) not in names]
            if unknown:
                raise ValueError(
                    f"model_parameters holds {len(unknown)} tensor(s) that are not parameters of the "
                    f"model passed to initialize (first has shape {tuple(unknown[0].shape)})")
            options = {k: v for k, v in group.items() if k != "params"}
            groups.append((options, [names[id(p)] for p in params if p.requires_grad]))
        named = {n for _, group_names in groups for n in group_names}
        trainable = {n for n, p in module.named_parameters() if p.requires_grad}
        return cls(groups, bool(trainable) and trainable <= named, frozen)

    @property
    def named(self) -> tuple[Groups, bool, frozenset[str]]:
        """What this rank's user selected and froze, for the ranks that may now hold its layers."""
        return self._groups, self.whole, self.frozen

    def joined(self, everyone: list[tuple[Groups, bool, frozenset[str]]], module: nn.Module) -> ParamSelection:
        """This selection plus what the other ranks' selections placed and this one did not,
        for the parameters `module` holds now (`everyone`: each rank's `named`, this rank's
        among them)."""
        groups = [(dict(options), list(names)) for options, names in self._groups]
        here = {n for n, _ in module.named_parameters()}
        placed = {n for _, names in groups for n in names}
        for theirs, _, _ in everyone:
            for index, (options, names) in enumerate(theirs):
                new = [n for n in names if n in here and n not in placed]
                if new:
                    _group_like(groups, options, index)[1].extend(new)
                    placed.update(new)
        frozen = frozenset().union(*(f for _, _, f in everyone)) & here - placed
        return ParamSelection(groups, all(whole for _, whole, _ in everyone), frozen)

    def keep_frozen(self, module: nn.Module) -> None:
        """Freeze again the parameters the user froze that a pipeline rebind built anew."""
        for name, p in module.named_parameters():
            if name in self.frozen:
                p.requires_grad_(False)

    def groups(self, module: nn.Module, master_of: dict[int, nn.Parameter]) -> list[dict]:
        """The groups over the rewritten `module`'s master tensors; group options (lr,
        weight_decay, ...) kept, frozen parameters left out."""
        by_name = {n: p for n, p in module.named_parameters() if p.requires_grad}
        out, placed = [], set()
        for options, names in self._groups:
            params = [by_name[n] for n in names if n in by_name and n not in placed]
            placed.update(n for n in names if n in by_name)
            out.append({**options, "params": [master_of[id(p)] for p in params]})
        rest = [p for n, p in by_name.items() if n not in placed]
        if self.whole and rest:  # the whole model: parameters no group names join the first
            out[0]["params"] += [master_of[id(p)] for p in rest]
        return out


def _group_like(groups: Groups, options: dict, index: int) -> tuple[dict, list[str]]:
    """The group of `groups` with these options (the one at `index` first), else a new one."""
    if index < len(groups) and groups[index][0] == options:
        return groups[index]
    for group in groups:
        if group[0] == options:
            return group
    groups.append((dict(options), []))
    return groups[-1]


def adopt_client_optimizer(
    optimizer: torch.optim.Optimizer | Callable, groups: list[dict]
) -> torch.optim.Optimizer:
    """Use a user-built optimizer (or factory) on the master tensors instead of the params:
    `groups` are its own param groups resolved by name (Note [model_parameters by name])."""
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        return optimizer(groups)
    if optimizer.state:
        raise ValueError("pass the optimizer to initialize() before its first step (its state is not empty)")
    for group, resolved in zip(optimizer.param_groups, groups):
        group["params"] = resolved["params"]
    for resolved in groups[len(optimizer.param_groups):]:  # options only another rank's groups had
        optimizer.add_param_group(resolved)
    return optimizer
