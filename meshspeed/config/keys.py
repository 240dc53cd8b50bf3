"""Walk a raw config dict against the models before pydantic sees it.

Pydantic alone would say "Extra inputs are not permitted" for a typo. This walk instead
names the full dotted path and the closest valid key, renames old spellings
(`StrictModel.key_aliases`), handles "auto" (Note ["auto" values]), and sets aside the
DeepSpeed keys meshspeed accepts but does not use yet (`known_keys.ACCEPTED_UNUSED`).

Note ["auto" values]
Hugging Face's Trainer and accelerate write "auto" for values they fill in before
`deepspeed.initialize` (batch sizes, bucket sizes, optimizer and scheduler params). What
they leave unfilled, DeepSpeed's typed sections read as "use the default"
(DeepSpeedConfigModel drops "auto" entries), and so does meshspeed: a key whose value is
"auto" is dropped, and the batch triad treats it as not given (derived from the others).
The exception is the free-form `optimizer.params` / `scheduler.params`, which DeepSpeed
hands to the optimizer as they are: there an "auto" is an error naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Any, get_args, get_origin

from meshspeed.config.base import StrictModel, closest
from meshspeed.config.errors import show
from meshspeed.config.known_keys import ACCEPTED_UNUSED, unused_children


@dataclass
class CheckedKeys:
    data: dict[str, Any]  # the input with aliases renamed and accepted-unused keys removed
    unused: dict[str, Any] = field(default_factory=dict)  # accepted-unused dotted path -> value
    problems: list[str] = field(default_factory=list)  # one line per bad key
    autos: list[str] = field(default_factory=list)  # keys left "auto", dropped (Note ["auto" values])


def check_keys(raw: dict[str, Any], model: type[StrictModel]) -> CheckedKeys:
    """Check every key of `raw`, at any depth, against `model` and its sub-models."""
    result = CheckedKeys(data={})
    result.data = _walk(raw, model, "", model, result)
    return result


def submodel(annotation: Any) -> type[StrictModel] | None:
    """The StrictModel inside a field annotation such as `ZeroConfig | None`, if any."""
    if isinstance(annotation, type) and issubclass(annotation, StrictModel):
        return annotation
    for arg in get_args(annotation):
        found = submodel(arg)
        if found is not None:
            return found
    return None


def mapping_of(annotation: Any) -> type[StrictModel] | None:
    """M for a field typed `dict[str, M]` (named groups such as compression's
    `different_groups`), possibly optional; None for any other annotation."""
    if get_origin(annotation) is dict:
        return submodel(get_args(annotation)[1])
    for arg in get_args(annotation):
        if get_origin(arg) is dict:
            return submodel(get_args(arg)[1])
    return None


def _walk(
    raw: dict[str, Any],
    model: type[StrictModel],
    path: str,
    root: type[StrictModel],
    result: CheckedKeys,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    spelled: dict[str, str] = {}  # field name -> the key the user wrote for it
    fields = model.model_fields
    unused_here = unused_children(path)
    for key, value in raw.items():
        full = f"{path}.{key}" if path else str(key)
        name = model.key_aliases.get(key, key)
        if name in fields:
            if name in spelled:
                if raw[spelled[name]] != value:
                    result.problems.append(
                        f"{full}: same setting as '{spelled[name]}' with a different value; "
                        "give only one of them"
                    )
                continue
            spelled[name] = key
            here = f"{path}.{name}" if path else name
            sub = submodel(fields[name].annotation)
            values = mapping_of(fields[name].annotation)
            if values is not None and isinstance(value, dict):  # {name: sub-model}
                out[name] = {k: _walk(v, values, f"{here}.{k}", root, result) if isinstance(v, dict)
                             else v for k, v in value.items()}
            elif sub is not None and isinstance(value, dict):
                out[name] = _walk(value, sub, here, root, result)
            elif not _found_auto(value, full, result):
                out[name] = value  # left out if "auto" (Note ["auto" values])
        elif key in model.legacy_keys:
            out[key] = value  # consumed by the model's own before-validator
        elif key in unused_here:
            result.unused[full] = value
        else:
            result.problems.append(_unknown(full, key, model, unused_here, root))
    return out


AUTO_MEANINGFUL = frozenset({"pipeline.stages"})  # DeepSpeed's own "auto": the model decides
AUTO_REFUSED = ("optimizer.params.", "scheduler.params.")  # handed on as written, as in DeepSpeed


def _found_auto(value: Any, path: str, result: CheckedKeys) -> bool:
    """Note ["auto" values] for `value` at `path`: True when it is "auto" (dropped, or an
    error in the free-form params)."""
    if path in AUTO_MEANINGFUL:
        return False
    if isinstance(value, str) and value == "auto":
        if path.startswith(AUTO_REFUSED):
            result.problems.append(_auto_refused(path))
        else:
            result.autos.append(path)
        return True
    _refuse_nested_auto(value, path, result.problems)  # a free-form dict or list is kept
    return False


def _refuse_nested_auto(value: Any, path: str, problems: list[str]) -> None:
    """Report every "auto" inside a free-form dict or list that the optimizer or scheduler
    would receive as written."""
    if isinstance(value, dict):
        items = [(f"{path}.{k}", v) for k, v in value.items()]
    elif isinstance(value, list):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    else:
        return
    for p, v in items:
        if isinstance(v, str) and v == "auto" and p.startswith(AUTO_REFUSED):
            problems.append(_auto_refused(p))
        else:
            _refuse_nested_auto(v, p, problems)


def _auto_refused(path: str) -> str:
    return (f'{path}: "auto" was not filled in; DeepSpeed hands optimizer and scheduler params to the '
            "optimizer as written, so give a number")


def _unknown(
    full: str, key: Any, model: type[StrictModel], unused_here: set[str], root: type[StrictModel]
) -> str:
    if not isinstance(key, str):
        return f"{full}: keys must be strings (got {show(key)})"
    here = set(model.model_fields) | set(model.key_aliases) | set(model.legacy_keys) | unused_here
    guess = closest(key, here)
    if guess is not None:
        return f"{full}: unknown key; did you mean '{guess}'?"
    parents = [p.rsplit(".", 1)[0] for p in _all_paths(root) if p.endswith(f".{key}")]
    if parents:
        where = ", ".join(f"'{p}'" for p in parents[:4]) + (", ..." if len(parents) > 4 else "")
        return f"{full}: unknown key here; '{key}' is a key inside {where}"
    msg = f"{full}: unknown key (neither meshspeed nor DeepSpeed has this setting)"
    if len(here) <= 30:
        msg += f"; valid keys here: {', '.join(sorted(here))}"
    return msg


@cache
def _all_paths(model: type[StrictModel], prefix: str = "") -> tuple[str, ...]:
    """Every dotted key path the schema knows, typed fields and accepted-unused keys."""
    paths: list[str] = []
    for name, info in model.model_fields.items():
        full = f"{prefix}.{name}" if prefix else name
        paths.append(full)
        sub = submodel(info.annotation)
        if mapping_of(info.annotation) is not None:
            paths.extend(_all_paths(sub, f"{full}.<name>"))
        elif sub is not None:
            paths.extend(_all_paths(sub, full))
    if not prefix:
        paths.extend(sorted(ACCEPTED_UNUSED))
    return tuple(paths)
