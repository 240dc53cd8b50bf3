"""Planning before anything runs: bytes per device for a ZeRO configuration (estimate), and
the ranked parallel layouts of a model on a cluster (plan)."""

from meshspeed.planner.activations import ModelShape, activation_bytes, param_count
from meshspeed.planner.cost import Candidate
from meshspeed.planner.estimate import (
    STAGE_NAMES,
    estimate_memory,
    estimate_table,
    format_report,
    format_table,
)
from meshspeed.planner.plan import Choice, Plan, plan

__all__ = [
    "STAGE_NAMES",
    "Candidate",
    "Choice",
    "ModelShape",
    "Plan",
    "activation_bytes",
    "estimate_memory",
    "estimate_table",
    "format_report",
    "format_table",
    "param_count",
    "plan",
]
