"""The strict base model every config section derives from, plus shared field types.

Every section is a small frozen pydantic model owned by the code that uses it. Unknown
keys are rejected (see `keys.py` for the did-you-mean walk that runs before pydantic);
`extra="forbid"` stays on as a backstop for models built directly in Python.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from typing_extensions import Self

from meshspeed.config.errors import ConfigError, problems_from_validation_error


class StrictModel(BaseModel):
    """Frozen, strictly typed, no unknown keys. Build from JSON data with `checked`."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, validate_default=True)

    # Old or alternative spellings of a field: {"old_name": "field_name"}. Renamed before
    # validation by `keys.check_keys`, which also rejects giving both spellings.
    key_aliases: ClassVar[dict[str, str]] = {}
    # Deprecated keys this model's own mode="before" validator translates and removes.
    legacy_keys: ClassVar[frozenset[str]] = frozenset()

    # Note: no __init__ override. pydantic calls a custom __init__ for nested models too,
    # which would turn nested errors into opaque value errors without key paths.

    @classmethod
    def checked(cls, data: dict[str, Any], prefix: str = "") -> Self:
        """Validate `data`, raising `ConfigError` (not pydantic's error) with key paths."""
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            raise ConfigError(problems_from_validation_error(err, prefix)) from None


def closest(key: str, candidates: Iterable[str]) -> str | None:
    """The candidate a misspelt `key` most likely meant, or None."""
    matches = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


def whole_number(value: Any) -> Any:
    # JSON configs write sizes as 5e8; accept a float that is a whole number for an int
    # field. Other non-ints (2.5, "3") are left for strict validation to reject; bools are
    # rejected here because Literal[0, 1, ...] would take true as 1.
    if isinstance(value, bool):
        # pydantic reports ValueError per key; a TypeError would escape unformatted.
        raise ValueError("expected an integer, not true/false")  # noqa: TRY004
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


def _casefold_choice(choices: tuple[str, ...]):
    """A before-validator mapping any capitalisation of a choice to its canonical spelling."""
    lookup = {c.lower(): c for c in choices}

    def canonical(value: Any) -> Any:
        if isinstance(value, str) and value.lower() in lookup:
            return lookup[value.lower()]
        return value

    return BeforeValidator(canonical)


# Integer fields: accept 5e8-style floats, reject bools and fractions.
Int = Annotated[int, BeforeValidator(whole_number)]
NonNegInt = Annotated[int, BeforeValidator(whole_number), Field(ge=0)]
PositiveInt = Annotated[int, BeforeValidator(whole_number), Field(ge=1)]
NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]


def CaseInsensitive(*choices: str) -> Any:  # capitalised: used in type position
    """A string field restricted to `choices`, matched case-insensitively."""
    return Annotated[Literal[choices], _casefold_choice(choices)]  # type: ignore[valid-type]
