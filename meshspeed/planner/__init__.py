"""Memory planning: bytes per device for a ZeRO configuration, before anything runs."""

from meshspeed.planner.activations import ModelShape, activation_bytes, param_count
from meshspeed.planner.estimate import (
    STAGE_NAMES,
    estimate_memory,
    estimate_table,
    format_report,
    format_table,
)

__all__ = [
    "STAGE_NAMES",
    "ModelShape",
    "activation_bytes",
    "estimate_memory",
    "estimate_table",
    "format_report",
    "format_table",
    "param_count",
]
