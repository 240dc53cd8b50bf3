"""DeepSpeed's AutoTP config form, read into a meshspeed plan.

    "tensor_parallel": {
        "autotp_size": 2,
        "tp_overlap_comm": false,
        "sequence_parallel": false,          # meshspeed's own key
        "partition_config": {
            "use_default_specs": true,       # DeepSpeed's default: merge the family's specs
            "layer_specs": [
                {"patterns": [".*\\.o_proj\\.weight$"], "partition_type": "row"},
                {"patterns": [".*\\.qkv\\.weight$"], "partition_type": "column",
                 "shape": [[q, kv, kv], -1], "partition_dim": 0}]}}

DeepSpeed matches each spec's regexes with `re.match` against PARAMETER names, first spec
wins (deepspeed/module_inject/autotp_config.py); a plan is keyed by MODULE names. So each
matched parameter's module gets an exact-name plan entry: "column"/"row", or "replicate"
for "skip". `shape` describes fused sub-parameters along the split dimension: `[3, -1]`
is three equal parts, `[[q, k, v], -1]` three given sizes; it becomes the entry's `parts`.

With use_default_specs the family plan (hf.py, or the model's own `tp_plan`), when the
model has one, is merged after the custom entries: it brings the vocab embedding and
head, the norms, the sequence-parallel boundaries and the loss, and a custom entry that
agrees with the family's kind for the same module inherits its options (head_dim,
layout). Without use_default_specs, or for a model of no known family (DeepSpeed merges
a preset only when there is one), only the listed linear layers are split (as DeepSpeed
does), and they run without sequence parallelism: there are no boundaries to enter and
leave it.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from meshspeed.tensor_parallel.apply import default_plan
from meshspeed.tensor_parallel.plan import PlanEntry, PlanError, normalize, resolve

_SPEC_KEYS = ("patterns", "partition_type", "shape", "partition_dim", "gather_output",
              "model_types", "grad_allreduce")
_TYPES = ("column", "row", "skip")
_WHERE = "tensor_parallel.partition_config"


def plan_from_deepspeed(partition_config: dict | None, model: nn.Module) -> dict[str, PlanEntry]:
    """A meshspeed plan for `model` from DeepSpeed's `partition_config` (None: defaults)."""
    config = dict(partition_config or {})
    unknown = sorted(set(config) - {"use_default_specs", "layer_specs", "strict_mode",
                                    "lm_head_patterns", "embedding_partition_dim"})
    if unknown:
        raise PlanError(f"{_WHERE}: unknown key(s) {unknown}")
    use_defaults = bool(config.get("use_default_specs", True))
    specs = config.get("layer_specs") or []
    if not specs:
        return normalize(default_plan(model))
    family = _family_plan(model) if use_defaults else {}
    use_defaults = use_defaults and bool(family)
    inherited = _family_by_module(model, family) if use_defaults else {}
    custom = _custom_entries(model, specs, inherited, use_defaults)
    return {**custom, **{p: e for p, e in family.items() if p not in custom}}


def _family_plan(model: nn.Module) -> dict[str, PlanEntry]:
    """The plan the custom specs merge into; none for a model of no known family (a
    PipelineModule of the user's own layers): DeepSpeed merges its preset only when there
    is one, and the listed layers are then the whole plan."""
    try:
        family = default_plan(model)
    except PlanError:
        return {}
    return normalize(family)


def _family_by_module(model: nn.Module, family: dict[str, PlanEntry]) -> dict[str, PlanEntry]:
    try:
        return {a.name: a.entry for a in resolve(model, family)}
    except PlanError:  # a family pattern missing here is reported when the plan is applied
        return {}


def _custom_entries(model: nn.Module, specs: list, inherited: dict[str, PlanEntry],
                    use_defaults: bool) -> dict[str, PlanEntry]:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    modules = dict(model.named_modules())
    params = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    entries: dict[str, PlanEntry] = {}
    problems: list[str] = []
    for i, spec in enumerate(specs):
        where = f"{_WHERE}.layer_specs[{i}]"
        kind = _spec_kind(spec, where, problems)
        if kind is None:
            continue
        types = spec.get("model_types")
        if types and str(model_type).lower() not in [str(t).lower() for t in types]:
            continue
        hits = [n for n in params if any(re.match(p, n) for p in spec.get("patterns", []))]
        if not hits:
            problems.append(f"{where}: patterns {spec.get('patterns')} match no parameter of "
                            f"{type(model).__name__}")
            continue
        for name in hits:
            module_name = name.rpartition(".")[0]
            if module_name in entries:  # an earlier spec matched it first
                continue
            entry = _entry(spec, kind, modules[module_name], module_name, where, problems)
            base = inherited.get(module_name)
            if entry is not None and base is not None and base.kind == entry.kind:
                entry = PlanEntry(entry.kind, parts=entry.parts or base.parts,
                                  multiple=base.multiple, weight_layout=base.weight_layout,
                                  sequence_parallel=base.sequence_parallel,
                                  gather_output=entry.gather_output)
            elif entry is not None and not use_defaults and entry.kind != "replicate":
                entry = PlanEntry(entry.kind, parts=entry.parts, sequence_parallel=False,
                                  gather_output=entry.gather_output)
            if entry is not None:
                entries[module_name] = entry
    if problems:
        raise PlanError(problems)
    return entries


def _spec_kind(spec: Any, where: str, problems: list[str]) -> str | None:
    if not isinstance(spec, dict):
        problems.append(f"{where}: expected an object, got {type(spec).__name__}")
        return None
    unknown = sorted(set(spec) - set(_SPEC_KEYS))
    if unknown:
        problems.append(f"{where}: unknown key(s) {unknown}; expected some of {list(_SPEC_KEYS)}")
        return None
    kind = str(spec.get("partition_type", "column")).lower()
    if kind not in _TYPES:
        problems.append(f"{where}.partition_type: {kind!r} is not one of {list(_TYPES)}")
        return None
    return {"skip": "replicate"}.get(kind, kind)


def _entry(spec: dict, kind: str, module: nn.Module, name: str, where: str,
           problems: list[str]) -> PlanEntry | None:
    if kind == "replicate":
        return PlanEntry("replicate")
    split_dim = 0 if kind == "column" else 1  # of an (out, in) weight, DeepSpeed's default
    dim = spec.get("partition_dim")
    if dim is not None and dim != split_dim:
        problems.append(f"{where}: {name} {kind} split along partition_dim {dim} is not "
                        f"supported (a {kind} split is along dim {split_dim})")
        return None
    parts = None
    shape = spec.get("shape")
    if shape is not None:
        if kind != "column":
            problems.append(f"{where}: {name}: fused sub-parameters (shape) are only "
                            f"supported for column splits")
            return None
        parts = _parts(shape, module, name, where, problems)
        if parts is None:
            return None
    return PlanEntry(kind, parts=parts, gather_output=bool(spec.get("gather_output", False)))


def _parts(shape: list, module: nn.Module, name: str, where: str,
           problems: list[str]) -> tuple[int, ...] | None:
    out = getattr(module, "out_features", None)
    if out is None:
        problems.append(f"{where}: {name}: shape needs an nn.Linear, got {type(module).__name__}")
        return None
    head = shape[0]
    if isinstance(head, (list, tuple)):
        parts = tuple(int(x) for x in head)
    elif isinstance(head, int) and head > 0 and out % head == 0:
        parts = (out // head,) * head
    else:
        problems.append(f"{where}: {name}: shape {shape} does not split its {out} outputs")
        return None
    if sum(parts) != out:
        problems.append(f"{where}: {name}: shape parts {list(parts)} add up to {sum(parts)}, "
                        f"not its {out} outputs")
        return None
    return parts
