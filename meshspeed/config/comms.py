"""Communication sections: the comms logger and the gradient reduction dtype.

Owned by `meshspeed/comm`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from meshspeed.config.base import StrictModel

# Spellings accepted for `communication_data_type`, mapped to DeepSpeed's short names.
_DTYPE_NAMES = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
}


def _canonical_dtype(value: Any) -> Any:
    if isinstance(value, str):
        if value.lower() == "none":
            return None
        return _DTYPE_NAMES.get(value.lower(), value)
    return value


# None means "reduce in the training dtype"; torch-style names are accepted.
CommDtype = Annotated[Literal["fp32", "fp16", "bf16"] | None, BeforeValidator(_canonical_dtype)]


class CommsLoggerConfig(StrictModel):
    """Record every collective meshspeed issues (op, bytes, time)."""

    enabled: bool = False
    verbose: bool = False  # print each operation as it happens
    prof_all: bool = True  # profile every op; if False only `prof_ops`
    debug: bool = False  # add the calling function to each record's name
    prof_ops: list[str] = Field(default_factory=list)  # e.g. ["all_reduce", "all_gather"]
