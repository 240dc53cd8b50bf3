"""The one error type for a bad meshspeed/DeepSpeed config, and pydantic error translation."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError


class ConfigError(ValueError):
    """A config that meshspeed cannot run: unknown key, wrong type, inconsistent values.

    The message has one line per problem, each starting with the dotted key path.
    """

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


def show(value: Any) -> str:
    """A value as the user wrote it in JSON (true, null, "cpu"), shortened if long."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def dotted(loc: tuple[Any, ...], prefix: str = "") -> str:
    """A pydantic error location as a key path: ('zero', 'offload', 0) -> 'zero.offload[0]'."""
    path = prefix
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path = f"{path}.{part}" if path else str(part)
    return path


# pydantic error type -> our wording; {..} are filled from the error's ctx.
_WORDING = {
    "int_type": "expected an integer",
    "int_parsing": "expected an integer",
    "int_from_float": "expected a whole number",
    "float_type": "expected a number",
    "float_parsing": "expected a number",
    "finite_number": "expected a finite number",
    "bool_type": "expected true or false",
    "bool_parsing": "expected true or false",
    "string_type": "expected a string",
    "list_type": "expected a list",
    "dict_type": "expected an object ({{...}})",
    "model_type": "expected an object ({{...}})",
    "model_attributes_type": "expected an object ({{...}})",
    "literal_error": "must be one of {expected}",
    "greater_than": "must be > {gt}",
    "greater_than_equal": "must be >= {ge}",
    "less_than": "must be < {lt}",
    "less_than_equal": "must be <= {le}",
    "missing": "is required",
    "extra_forbidden": "unknown key",
    "none_required": "must be null",
}


def problems_from_validation_error(err: ValidationError, prefix: str = "") -> list[str]:
    """One clean line per pydantic error: '<key path>: <what is wrong> (got <value>)'."""
    lines = []
    for e in err.errors(include_url=False):
        loc = tuple(p for p in e["loc"] if not _is_pydantic_tag(p))
        path = dotted(loc, prefix)
        ctx = e.get("ctx") or {}
        if e["type"] == "value_error":
            msg = str(ctx.get("error", e["msg"]))
        else:
            template = _WORDING.get(e["type"])
            msg = template.format(**ctx) if template else e["msg"]
        # A whole section as "got" is noise: cross-field errors name their keys instead.
        quiet = e["type"] in ("missing", "extra_forbidden") or isinstance(e["input"], dict)
        got = "" if quiet else f" (got {show(e['input'])})"
        line = f"{path}: {msg}{got}" if path else msg
        if line not in lines:
            lines.append(line)
    return lines


def _is_pydantic_tag(part: Any) -> bool:
    # Union/function validators add loc entries such as 'function-after[...]' or 'int';
    # they name pydantic internals, not config keys.
    return isinstance(part, str) and (
        "[" in part or part in ("int", "float", "str", "bool", "none", "list", "dict")
    )
