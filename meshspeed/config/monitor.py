"""The observability sections: `flops_profiler`, `tensorboard`, `csv_monitor`, `wandb`.

Owned by `meshspeed/profiling` (the profiler) and `meshspeed/monitor` (the writers).
Names and defaults are DeepSpeed's, so a DeepSpeed config's blocks load unchanged.
"""

from __future__ import annotations

from pydantic import Field

from meshspeed.config.base import Int, NonNegInt, PositiveInt, StrictModel


class FlopsProfilerConfig(StrictModel):
    """Profile one optimizer step: per-module FLOPs, MACs, parameters, forward latency."""

    enabled: bool = False
    # optimizer step to profile (0 = the first); later steps are past the warm-up
    profile_step: NonNegInt = 1
    module_depth: Int = Field(default=-1, ge=-1)  # depth of the module tree printed; -1 = all
    top_modules: PositiveInt = 1  # modules listed per depth in the "top modules" section
    detailed: bool = True  # print the module tree
    output_file: str | None = None  # append the profile here instead of printing it
    # DeepSpeed's share of a forward recomputed by activation checkpointing; meshspeed
    # counts recomputed ops as they run, so this is checked and otherwise unused
    recompute_fwd_factor: float = Field(default=0.0, ge=0.0, le=1.0)


class FileMonitorConfig(StrictModel):
    """A monitor writing files under output_path/job_name (tensorboard, csv_monitor)."""

    enabled: bool = False
    output_path: str = ""  # directory for the job's folder; "" = the working directory
    job_name: str = "DeepSpeedJobName"  # DeepSpeed's default, so paths match its runs


class WandbConfig(StrictModel):
    """Weights & Biases (only when the `wandb` package is installed)."""

    enabled: bool = False
    group: str | None = None
    team: str | None = None  # the wandb entity
    project: str = "deepspeed"
