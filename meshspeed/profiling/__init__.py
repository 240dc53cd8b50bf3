"""Measuring a model and a run: the FLOPs profiler and the per-phase step timers.

flops_profiler.py  get_model_profile, FlopsProfiler (DeepSpeed's names): per-module FLOPs,
                   MACs, parameters and forward latency, counted from the aten ops that run
op_flops.py        the FLOPs of one aten op, from its shapes
report.py          the profile as text
timers.py          StepTimers: forward / backward / step / communication time per step
                   (`wall_clock_breakdown`)
"""

from meshspeed.profiling.flops_profiler import FlopsProfiler, get_model_profile
from meshspeed.profiling.timers import StepTimers

__all__ = ["FlopsProfiler", "StepTimers", "get_model_profile"]
