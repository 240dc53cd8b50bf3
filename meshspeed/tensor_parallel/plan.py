"""A tensor-parallel plan: which modules split how, checked against a model before anything
is split.

A plan is plain data, so a model can ship one without importing meshspeed (the reference
GPT's `GPT.tp_plan`) and a config can carry one. It maps fnmatch-style globs over
`named_modules()` names to an entry; an entry is a kind string or a dict:

    {"layers.*.attn.wq": {"kind": "column", "multiple": "head_dim"},
     "layers.*.attn.wo": "row",
     "tok_emb": "vocab", "lm_head": "vocab_head", "loss_fn": "loss"}

Kinds (Megatron-LM, arXiv:1909.08053; sequence parallelism arXiv:2205.05198):
  column         nn.Linear / HF Conv1D split along its outputs
  row            split along its inputs; partial outputs summed (or reduce-scattered)
  vocab          nn.Embedding split along the vocabulary
  vocab_head     the output projection, producing this rank's vocabulary shard of the logits
                 (tied to the vocab embedding's Parameter when the model ties them)
  sequence_norm  a norm that runs on a sequence shard under sequence parallelism
  loss           an nn.CrossEntropyLoss module (or HF's `loss_function`) swapped for the
                 vocab-parallel cross-entropy, so full-vocabulary logits are never built
  replicate      nothing split; only for entries that carry sequence-boundary options

Entry options:
  parts            column/row: sizes of fused sub-outputs laid end to end, each split on its
                   own (GPT-2's q|k|v); ints, or names of `model.config` attributes
  multiple         a head dimension: every rank's share of each part is whole heads; an
                   int or the name of a `model.config` attribute ("head_dim")
  weight_layout    "out_in" (nn.Linear) or "in_out" (HF Conv1D); inferred when omitted
  sequence_parallel  column/row/vocab/vocab_head: override the global flag for this layer
                   (False for layers inside a region that a boundary option gathered)
  sp_input         "scatter": under SP, split the module's hidden-state input along the
                   sequence; "gather": all-gather it (see Note [HF sequence boundaries] in hf.py)
  sp_output        "gather": under SP, all-gather the module's output along the sequence
  gather_output    column: all-gather the split outputs, so the result is replicated
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from meshspeed.config.errors import ConfigError

KINDS = ("column", "row", "vocab", "vocab_head", "sequence_norm", "loss", "replicate")
_OPTIONS = ("kind", "parts", "multiple", "weight_layout", "sequence_parallel", "sp_input",
            "sp_output", "gather_output")
HF_LOSS = "loss_function"  # a "loss" pattern naming HF's PreTrainedModel.loss_function


class PlanError(ConfigError):
    """A plan that cannot be applied to this model; one line per problem."""


@dataclass(frozen=True)
class PlanEntry:
    kind: str
    parts: tuple[int | str, ...] | None = None
    multiple: int | str = 1
    weight_layout: str | None = None  # None: "in_out" for HF Conv1D, else "out_in"
    sequence_parallel: bool | None = None  # None: the global flag
    sp_input: str | None = None  # None | "scatter" | "gather"
    sp_output: str | None = None  # None | "gather"
    gather_output: bool = False  # column: all-gather the output (replicated result)


@dataclass(frozen=True)
class Assignment:
    """One module the plan matched, with its entry's names resolved to numbers."""

    name: str
    pattern: str
    entry: PlanEntry
    parts: tuple[int, ...] | None
    multiple: int


def normalize(plan: Mapping[str, str | Mapping | PlanEntry]) -> dict[str, PlanEntry]:
    """Plan data -> {pattern: PlanEntry}; unknown kinds and options raise PlanError."""
    if not isinstance(plan, Mapping):
        raise PlanError(f"a tensor-parallel plan must be a dict of pattern -> kind, got "
                        f"{type(plan).__name__}")
    out, problems = {}, []
    for pattern, raw in plan.items():
        if isinstance(raw, PlanEntry):
            out[pattern] = raw
            continue
        data = {"kind": raw} if isinstance(raw, str) else dict(raw)
        unknown = sorted(set(data) - set(_OPTIONS))
        if unknown:
            problems.append(f"plan[{pattern!r}]: unknown option(s) {unknown}; expected some "
                            f"of {list(_OPTIONS)}")
            continue
        if data.get("kind") not in KINDS:
            problems.append(f"plan[{pattern!r}]: kind {data.get('kind')!r} is not one of "
                            f"{list(KINDS)}")
            continue
        if data.get("parts") is not None:
            data["parts"] = tuple(data["parts"])
        if data.get("sp_input") not in (None, "scatter", "gather") or \
                data.get("sp_output") not in (None, "gather"):
            problems.append(f"plan[{pattern!r}]: sp_input must be 'scatter' or 'gather' and "
                            f"sp_output 'gather'")
            continue
        out[pattern] = PlanEntry(**data)
    if problems:
        raise PlanError(problems)
    return out


def is_conv1d(module: nn.Module) -> bool:
    """HF's transformers.pytorch_utils.Conv1D (weight stored (in, out)), found by shape so
    that this module need not import transformers."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _linear_sizes(module: nn.Module) -> tuple[int, int] | None:
    """(in_features, out_features) of a Linear or Conv1D, else None."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if is_conv1d(module):
        return module.weight.shape[0], module.weight.shape[1]
    return None


def _number(value: int | str, config, pattern: str, problems: list[str]) -> int:
    if isinstance(value, int):
        return value
    got = getattr(config, value, None)
    if not isinstance(got, int):
        problems.append(f"plan[{pattern!r}]: {value!r} is not an integer attribute of the "
                        f"model's config")
        return 1
    return got


def resolve(model: nn.Module, plan: dict[str, PlanEntry]) -> list[Assignment]:
    """Match every pattern; each module takes the first pattern (in plan order) that matches
    it. A pattern matching no module is an error (usually a typo or another model's plan)."""
    names = [n for n, _ in model.named_modules() if n]
    config = getattr(model, "config", None)
    taken: dict[str, Assignment] = {}
    problems = []
    for pattern, entry in plan.items():
        if entry.kind == "loss" and pattern == HF_LOSS:
            hits = [HF_LOSS] if hasattr(model, HF_LOSS) else []
        else:
            hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            problems.append(f"plan pattern {pattern!r} ({entry.kind}) matches no module of "
                            f"{type(model).__name__}")
            continue
        parts = None if entry.parts is None else tuple(
            _number(p, config, pattern, problems) for p in entry.parts)
        multiple = _number(entry.multiple, config, pattern, problems)
        for name in hits:
            taken.setdefault(name, Assignment(name, pattern, entry, parts, multiple))
    if problems:
        raise PlanError(problems)
    order = {n: i for i, n in enumerate(names)}
    return sorted(taken.values(), key=lambda a: order.get(a.name, -1))


def check(model: nn.Module, assignments: list[Assignment], tp: int) -> None:
    """Every reason the assignments cannot be split over `tp` ranks, raised together as one
    PlanError before any module changes."""
    modules = dict(model.named_modules())
    by_name = {a.name: a for a in assignments}
    problems: list[str] = []
    for a in assignments:
        if a.name == HF_LOSS:
            continue
        problem = _check_one(a, modules[a.name], tp)
        if problem:
            problems.append(problem)
    problems += _check_ties(model, modules, by_name)
    if problems:
        raise PlanError(problems)


def _check_one(a: Assignment, module: nn.Module, tp: int) -> str | None:
    kind, kname = a.entry.kind, type(module).__name__
    if kind in ("column", "row"):
        sizes = _linear_sizes(module)
        if sizes is None:
            return f"{a.name}: a {kind} split needs an nn.Linear or HF Conv1D, got {kname}"
        split = sizes[1] if kind == "column" else sizes[0]
        what = "outputs" if kind == "column" else "inputs"
        parts = a.parts or (split,)
        if sum(parts) != split:
            return (f"{a.name}: fused parts {list(parts)} add up to {sum(parts)}, not its "
                    f"{split} {what}")
        for part in parts:
            if part % a.multiple:
                return (f"{a.name}: {part} {what} are not whole heads of head_dim "
                        f"{a.multiple}")
            heads = part // a.multiple
            if a.multiple > 1 and heads % tp:
                return (f"{a.name}: {heads} heads (of head_dim {a.multiple}) do not divide "
                        f"over tp={tp}")
            if heads % tp:
                return (f"{a.name}: {part} {what} do not split evenly over tp={tp}")
    elif kind == "vocab" and not isinstance(module, nn.Embedding):
        return f"{a.name}: a vocab split needs an nn.Embedding, got {kname}"
    elif kind == "vocab_head" and not isinstance(module, nn.Linear):
        return f"{a.name}: a vocab_head split needs an nn.Linear, got {kname}"
    elif kind == "sequence_norm" and (_linear_sizes(module) is not None
                                      or isinstance(module, nn.Embedding)):
        return f"{a.name}: sequence_norm is for norm layers, got {kname}"
    elif kind == "loss":
        if not isinstance(module, nn.CrossEntropyLoss):
            return f"{a.name}: a loss entry needs an nn.CrossEntropyLoss, got {kname}"
        if module.label_smoothing or module.weight is not None:
            return (f"{a.name}: the vocab-parallel cross-entropy has no label_smoothing or "
                    f"class weights")
    return None


def _check_ties(model: nn.Module, modules: dict[str, nn.Module],
                by_name: dict[str, Assignment]) -> list[str]:
    """A Parameter shared by several modules (a tied lm_head) must be split by all of them
    the same way -- in practice a vocab embedding and a vocab_head -- or by none: splitting
    one side only would silently untie them."""
    users: dict[int, list[str]] = {}
    for name, module in modules.items():
        for pname, param in module.named_parameters(recurse=False):
            users.setdefault(id(param), []).append(f"{name}.{pname}" if name else pname)
    problems = []
    for names in users.values():
        if len(names) < 2:
            continue
        kinds = {n: by_name[n.rsplit(".", 1)[0]].entry.kind
                 if n.rsplit(".", 1)[0] in by_name else None for n in names}
        split = {n: k for n, k in kinds.items() if k not in (None, "replicate", "sequence_norm")}
        if not split or sorted(set(split.values())) == ["vocab", "vocab_head"] \
                and len(split) == len(names):
            continue
        first, other = next(iter(split)), next(n for n in names if n != next(iter(split)))
        problems.append(f"{first.rsplit('.', 1)[0]}: its weight is tied to {other}, which the "
                        f"plan splits as {kinds[other] or 'nothing'} rather than "
                        f"{'vocab' if split[first] == 'vocab_head' else 'vocab_head'} (split "
                        f"both as vocab/vocab_head, or neither)")
    return problems
