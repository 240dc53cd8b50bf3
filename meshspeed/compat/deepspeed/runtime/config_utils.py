"""`deepspeed.runtime.config_utils`: DeepSpeed's base class for config sections.

`DeepSpeedConfigModel` is the pydantic base that DeepSpeed's sections, and libraries
that extend DeepSpeed, derive from. It is looser than meshspeed's `StrictModel`:
values are converted where pydantic can ("3" for a number), instances are mutable
(assignment is validated), fields may be filled by their alias or their name, and
"auto" values are dropped so the default applies (Note ["auto" values] in
meshspeed/config/keys.py). Unknown keys stay errors.

Note [deprecated fields]
A field declared with `Field(..., json_schema_extra={"deprecated": True, "new_param":
"other", "new_param_fn": f})` is an old spelling: a value given for it is converted by
`f` (default: unchanged) and moved to `other` ("a.b" for a field of a sub-section)
before validation, so the new field's type checks it, and the old field keeps its
default. Giving both spellings is a `DeprecatedFieldConflict`, an AssertionError as in
DeepSpeed. `"set_new_param": False` only logs the deprecation.

The DeepSpeed views of meshspeed's sections (runtime/zero/config.py,
runtime/precision_config.py) derive from this class and from meshspeed's model, so a
view is a meshspeed section too; their old spellings are meshspeed's `key_aliases`,
renamed here the same way.
"""

from __future__ import annotations

import logging
from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, model_validator

from meshspeed.config.errors import ConfigError

__all__ = ["DeepSpeedConfigModel", "DeprecatedFieldConflict", "get_config_default", "get_scalar_param"]

logger = logging.getLogger("meshspeed")

# DeepSpeed's construction rules (see the module docstring); a view sets this over
# meshspeed's frozen, strict model_config
DEEPSPEED_MODEL_CONFIG = ConfigDict(
    validate_default=True,
    validate_assignment=True,
    use_enum_values=True,
    populate_by_name=True,
    extra="forbid",
    arbitrary_types_allowed=True,
    protected_namespaces=(),
    strict=False,
    frozen=False,
)


class DeprecatedFieldConflict(ConfigError, AssertionError):
    """An old and a new spelling of one setting were both given (Note [deprecated fields])."""


class DeepSpeedConfigModel(BaseModel):
    """A config section with DeepSpeed's rules: lax types, mutable, old spellings moved
    to new fields (Note [deprecated fields]), "auto" values dropped unless `strict=True`."""

    model_config = DEEPSPEED_MODEL_CONFIG

    def __init__(self, strict: bool = False, **data: Any):
        if not strict:  # Note ["auto" values] in meshspeed/config/keys.py
            data = {k: v for k, v in data.items() if not (isinstance(v, str) and v == "auto")}
        for old, new in _deprecated(type(self)).items():
            if old in data and new is not None and _given(data, new):
                raise DeprecatedFieldConflict(
                    f"{old} is the deprecated spelling of {new}; give only {new}")
        super().__init__(**data)

    @model_validator(mode="before")
    @classmethod
    def _new_spellings(cls, data: Any) -> Any:
        """Old spellings to their fields: meshspeed's key_aliases, then deprecated fields."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for old, new in getattr(cls, "key_aliases", {}).items():
            if old in data:
                value = data.pop(old)
                if new in data and data[new] != value:
                    raise ValueError(f"{old} and {new} are the same setting with different values; "
                                     "give only one of them")
                data.setdefault(new, value)
        for old, new in _deprecated(cls).items():
            if old not in data:
                continue
            logger.warning("config key %s is deprecated%s", old, f"; use {new}" if new else "")
            if new is None:
                continue
            fn = cls.model_fields[old].json_schema_extra.get("new_param_fn", lambda x: x)
            _put(data, new, fn(data.pop(old)))
        return data


def _deprecated(cls: type[BaseModel]) -> dict[str, str | None]:
    """Deprecated field -> the field that replaces it (None: only logged)."""
    out: dict[str, str | None] = {}
    for name, info in cls.model_fields.items():
        extra = info.json_schema_extra
        if isinstance(extra, dict) and extra.get("deprecated"):
            new = extra.get("new_param") or None
            out[name] = new if extra.get("set_new_param", True) else None
    return out


def _given(data: dict[str, Any], path: str) -> bool:
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _put(data: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    node = data
    for part in parents:
        child = node.get(part)
        child = dict(child) if isinstance(child, dict) else {}
        node[part] = child
        node = child
    node[leaf] = value


def get_config_default(config: type[BaseModel] | BaseModel, field_name: str) -> Any:
    """The default of `field_name` in a config model."""
    fields = type(config).model_fields if isinstance(config, BaseModel) else config.model_fields
    if field_name not in fields:
        raise ConfigError(f"{field_name!r} is not a field of {getattr(config, '__name__', type(config).__name__)}; "
                          f"fields: {', '.join(fields)}")
    if fields[field_name].is_required():
        raise ConfigError(f"{field_name!r} is required and has no default")
    return fields[field_name].get_default(call_default_factory=True)


def get_scalar_param(param_dict: dict[str, Any], name: str, default: Any) -> Any:
    """`param_dict[name]`, or `default` when the key is missing (DeepSpeed's reader)."""
    return param_dict.get(name, default)



def view_of(cls: type[DeepSpeedConfigModel], section: BaseModel, raw: dict[str, Any] | None = None) -> Any:
    """The DeepSpeed view `cls` of a parsed meshspeed section: every typed value as meshspeed
    resolved it, plus the DeepSpeed-only keys that `raw` (the section as the user wrote it)
    gives, at any depth."""
    data = section.model_dump()
    _merge_deepspeed_only(cls, data, raw or {})
    return cls(**data)


def _merge_deepspeed_only(cls: type[BaseModel], data: dict[str, Any], raw: dict[str, Any]) -> None:
    # every meshspeed field is in `data` already; a field of the view that is not is DeepSpeed's
    aliases = getattr(cls, "key_aliases", {})
    for key, value in raw.items():
        name = aliases.get(key, key)
        if name not in cls.model_fields:
            continue  # a legacy key meshspeed translated, or one it set aside
        if name not in data:
            data[name] = value
        elif isinstance(value, dict) and isinstance(data[name], dict):
            sub = _view_class(cls.model_fields[name].annotation)
            if sub is not None:
                _merge_deepspeed_only(sub, data[name], value)


def _view_class(annotation: Any) -> type[DeepSpeedConfigModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, DeepSpeedConfigModel):
        return annotation
    for arg in get_args(annotation):
        found = _view_class(arg)
        if found is not None:
            return found
    return None
