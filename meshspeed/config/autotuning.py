"""The `autotuning` section: DeepSpeed's keys and defaults, read by meshspeed/autotune.

`meshspeed autotune` (or `meshspeed run --autotuning tune|run`) measures the planner's
best layouts on the real machine (docs/autotune.md). Keys DeepSpeed's tuner has and
meshspeed's reads differently are noted where they are declared.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from meshspeed.config.base import NonNegInt, PositiveInt, StrictModel


class AutotuningConfig(StrictModel):
    enabled: bool = False
    # DeepSpeed: true tunes micro-batch sizes within a few ZeRO stages only; meshspeed always
    # measures only the planner's top candidates, so fast=false widens nothing (accepted)
    fast: bool = True
    results_dir: str = "autotuning_results"  # best_config.json, summary.md / summary.json
    exps_dir: str = "autotuning_exps"  # one folder per trial: its config, log and metrics
    overwrite: bool = True  # false: refuse to tune when results_dir already holds a summary
    # optimizer steps timed in each trial: from the end of step start to the end of step
    # end, so the first (slow, allocating) steps are not counted
    start_profile_step: PositiveInt = 3
    end_profile_step: PositiveInt = 5
    metric_path: str | None = None  # accepted; meshspeed puts each trial's metrics in exps_dir
    metric: Literal["throughput", "latency", "flops"] = "throughput"
    # order the candidates are tried in: the planner's predicted order (model_based; also
    # used for gridsearch, whose grid the planner has already pruned) or shuffled (random)
    tuner_type: Literal["gridsearch", "random", "model_based"] = "gridsearch"
    tuner_early_stopping: PositiveInt = 5  # stop after this many trials without a better one
    tuner_num_trials: PositiveInt = 50  # most trials (the CLI's --top-k, when given, wins)
    # config key (dotted) -> the script's argument that must carry the same value, for
    # scripts that read e.g. the micro-batch size from their own flag
    arg_mappings: dict[str, str] = Field(default_factory=dict)
    model_info: dict[str, Any] | None = None  # DeepSpeed's model facts; meshspeed probes them
    model_info_path: str | None = None  # accepted; see model_info
    mp_size: PositiveInt = 1  # model-parallel (tensor-parallel) degree the tuner keeps fixed
    max_train_batch_size: PositiveInt | None = None  # bounds checked against train_batch_size
    min_train_batch_size: PositiveInt = 1
    max_train_micro_batch_size_per_gpu: PositiveInt = 1024  # micro-batches tried lie in
    min_train_micro_batch_size_per_gpu: PositiveInt = 1  # [min, max]
    num_tuning_micro_batch_sizes: PositiveInt = 3  # most distinct micro-batch sizes tried
    # trial wall-clock limit in seconds, 0 = none (meshspeed's key; the CLI's --timeout wins)
    trial_timeout: NonNegInt = 0

    @model_validator(mode="after")
    def _ordered(self):
        if self.end_profile_step <= self.start_profile_step:
            raise ValueError(f"autotuning.end_profile_step ({self.end_profile_step}) must be after "
                             f"start_profile_step ({self.start_profile_step}): the steps between are timed")
        if self.max_train_micro_batch_size_per_gpu < self.min_train_micro_batch_size_per_gpu:
            raise ValueError("autotuning.max_train_micro_batch_size_per_gpu is below "
                             "min_train_micro_batch_size_per_gpu; no micro-batch size is left to try")
        if self.max_train_batch_size is not None and self.max_train_batch_size < self.min_train_batch_size:
            raise ValueError("autotuning.max_train_batch_size is below min_train_batch_size")
        return self
