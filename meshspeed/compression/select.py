"""Which layers each group of the config names, checked.

As in DeepSpeed (`compress.get_module_name`), every entry of `modules` is a regular
expression searched (`re.search`, so a plain string matches as a substring) in the names
of `model.named_modules()`, and only layers a technique can act on count; "attention.self"
names every layer whose name contains it. Unlike DeepSpeed, which crashed or did nothing,
these are one-sentence `ConfigError`s: a pattern that is not a regular expression, one that
names no layer of the technique's kinds, one that names a layer of another kind (an
Embedding for pruning), a layer named by two groups of one technique, and related
patterns that name a different number of layers than their pattern.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from meshspeed.compression.layers import Compressed
from meshspeed.config.compression import TECHNIQUES, CompressionConfig
from meshspeed.config.errors import ConfigError

# the torch layers each technique acts on, and those its related_modules may name
KINDS: dict[str, tuple[type[nn.Module], ...]] = {
    "weight_quantization": (nn.Linear, nn.Conv2d, nn.Embedding),
    "activation_quantization": (nn.Linear, nn.Conv2d),
    "sparse_pruning": (nn.Linear, nn.Conv2d),
    "row_pruning": (nn.Linear,),
    "head_pruning": (nn.Linear,),
    "channel_pruning": (nn.Conv2d,),
}
RELATED_KINDS: dict[str, tuple[type[nn.Module], ...]] = {
    "row_pruning": (nn.Linear,),  # their input columns go
    "head_pruning": (nn.Linear,),  # Q/K/V: the rows of the pruned heads go
    "channel_pruning": (nn.Conv2d, nn.BatchNorm2d),  # input channels / features go
}
_LAYERS = (nn.Linear, nn.Conv2d, nn.Embedding, nn.BatchNorm2d)


@dataclass(frozen=True)
class Selection:
    """The layers one entry `modules[index]` of one group names, with their related layers."""

    technique: str
    group: str
    index: int
    modules: tuple[str, ...]
    related: tuple[tuple[str, ...], ...] = ()  # per related pattern, paired with `modules`


def kind_of(module: nn.Module) -> type[nn.Module] | None:
    """The plain torch layer class `module` is (or wraps), None for anything else; subclasses
    of torch layers are not layers here: their forward may not read `weight` as torch's does."""
    if isinstance(module, Compressed):
        return module.BASE
    return type(module) if type(module) in _LAYERS else None


def _names(kinds: tuple) -> str:
    names = [k.__name__ for k in kinds]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def match(model: nn.Module, pattern: str, kinds: tuple, where: str) -> list[str]:
    """Names of the layers of `kinds` whose name contains a match of `pattern`."""
    try:
        regex = re.compile(pattern)
    except re.error as err:
        raise ConfigError(f"{where}: {pattern!r} is not a regular expression ({err})") from None
    found, other = [], []
    for name, module in model.named_modules():
        kind = kind_of(module)
        if kind is None or not regex.search(name):
            continue
        (found if kind in kinds else other).append(f"{name} ({kind.__name__})")
    if other:
        raise ConfigError(f"{where}: {pattern!r} names {', '.join(other[:3])}, which this "
                          f"technique does not apply to (only {_names(kinds)}); narrow the pattern")
    if not found:
        layers = [n for n, m in model.named_modules() if kind_of(m) in kinds]
        seen = ", ".join(f"'{n}'" for n in layers[:4]) or "none in this model"
        raise ConfigError(f"{where}: {pattern!r} matches no {_names(kinds)} layer; patterns are "
                          f"regular expressions searched in module names such as {seen}")
    return [f.rsplit(" (", 1)[0] for f in found]


def plan(model: nn.Module, cfg: CompressionConfig) -> list[Selection]:
    """Every enabled technique's selections, in the config's order, checked."""
    out = []
    for technique in TECHNIQUES:
        section = getattr(cfg, technique)
        if not section.shared_parameters.enabled:
            continue
        owner: dict[str, str] = {}  # layer -> the group that named it
        for group, spec in section.different_groups.items():
            base = f"compression_training.{technique}.different_groups.{group}"
            for i, pattern in enumerate(spec.modules):
                names = match(model, pattern, KINDS[technique], f"{base}.modules[{i}]")
                for name in names:
                    if name in owner:
                        raise ConfigError(f"{base}.modules[{i}]: {name} is already named by group "
                                          f"'{owner[name]}' of {technique}; name each layer in one "
                                          "group per technique")
                    owner[name] = group
                related = _related(model, technique, spec, i, len(names), base)
                out.append(Selection(technique, group, i, tuple(names), related))
    return out


def _related(model, technique, spec, i, count, base) -> tuple[tuple[str, ...], ...]:
    if spec.related_modules is None:
        return ()
    out = []
    for j, pattern in enumerate(spec.related_modules[i]):
        where = f"{base}.related_modules[{i}][{j}]"
        names = match(model, pattern, RELATED_KINDS[technique], where)
        if len(names) != count:
            raise ConfigError(f"{where}: {pattern!r} names {len(names)} layers and modules[{i}] "
                              f"names {count}; the n-th related layer is paired with the n-th "
                              "pruned one, so they must be as many")
        out.append(tuple(names))
    return tuple(out)
