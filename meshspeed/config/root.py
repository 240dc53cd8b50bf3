"""`MeshspeedConfig`: the whole training config, one field per owner's section."""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from meshspeed.config.activation import ActivationCheckpointingConfig
from meshspeed.config.autotuning import AutotuningConfig
from meshspeed.config.base import Int, NonNegFloat, PositiveFloat, PositiveInt, StrictModel
from meshspeed.config.batch import BATCH_KEYS
from meshspeed.config.checkpoint import CheckpointConfig
from meshspeed.config.comms import CommDtype, CommsLoggerConfig
from meshspeed.config.composition import config_features, refusals
from meshspeed.config.compression import CompressionConfig
from meshspeed.config.context_parallel import ContextParallelConfig, resolve
from meshspeed.config.errors import show
from meshspeed.config.gradient_compression import GradientCompressionConfig
from meshspeed.config.monitor import FileMonitorConfig, FlopsProfilerConfig, WandbConfig
from meshspeed.config.offload import AioConfig
from meshspeed.config.optim import OptimizerConfig, SchedulerConfig
from meshspeed.config.pipeline import PipelineConfig
from meshspeed.config.precision import BF16Config, FP16Config
from meshspeed.config.tensor_parallel import TensorParallelConfig
from meshspeed.config.zero import ZeroConfig

if TYPE_CHECKING:
    import torch


class MeshspeedConfig(StrictModel):
    """A resolved, immutable training config (DeepSpeed JSON names and defaults).

    Build it with `load_config`, which also derives the batch triad for the real
    data-parallel world size and gives did-you-mean errors for unknown keys.
    `MeshspeedConfig.checked(dict)` checks types only. Frozen: derive a changed copy
    with `model_copy(update=...)` rather than mutating.
    """

    key_aliases: ClassVar[dict[str, str]] = {
        "bfloat16": "bf16"
    }  # DeepSpeed's older name for the bf16 section

    train_batch_size: PositiveInt = 1  # = micro batch * accumulation steps * DP world size
    train_micro_batch_size_per_gpu: PositiveInt = 1
    gradient_accumulation_steps: PositiveInt = 1
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    # max global grad norm; 0 disables clipping. The default is DeepSpeed's up to 0.19.2;
    # DeepSpeed 0.19.3+ clips at 1.0 when the key is missing (its PR #8068): a config that
    # relies on that says "gradient_clipping": 1.0 (tests/engine/test_example_optimizer_parity.py)
    gradient_clipping: NonNegFloat = 0.0
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    steps_per_print: PositiveInt = 10  # infinity (accelerate's way of silencing it): never
    comms_timeout: PositiveFloat = 300.0  # seconds a collective may wait: then CommTimeoutError
    # skip (on every rank) and report a step whose gradients hold NaN/inf, as fp16 does;
    # one scalar all-reduce per step when gradients are sharded
    check_finite: bool = False
    # time forward / backward / step / communication per step, printed every steps_per_print
    wall_clock_breakdown: bool = False
    dump_state: bool = False  # print the resolved config after initialize
    # meshspeed's own key: the level of its log on rank 0 (banner, steps_per_print lines,
    # progress); "warning" quiets them. MESHSPEED_LOG_LEVEL wins over it; None: "info"
    # (meshspeed/process/speak.py, docs/observability.md)
    log_level: Literal["debug", "info", "warning", "error"] | None = None
    seed: Int | None = None
    prescale_gradients: bool = False  # divide gradients before (not after) reduction
    gradient_predivide_factor: PositiveFloat = 1.0  # divide by this before, the rest after
    # how data-parallel gradients combine: "mean" is what meshspeed does; DeepSpeed's "sum" is
    # parsed (any capitalisation) and refused when an engine is built (no_effect.REFUSED)
    gradient_allreduce_op: Literal["mean", "sum"] = "mean"
    communication_data_type: CommDtype = None  # gradient reduction dtype; None = training dtype
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    # observability: meshspeed/profiling and meshspeed/monitor (docs/observability.md)
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    tensorboard: FileMonitorConfig = Field(default_factory=FileMonitorConfig)
    csv_monitor: FileMonitorConfig = Field(default_factory=FileMonitorConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    # read by `meshspeed autotune` / `meshspeed run --autotuning`, not by the engine
    autotuning: AutotuningConfig = Field(default_factory=AutotuningConfig)
    aio: AioConfig = Field(default_factory=AioConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig
    )
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    # DeepSpeed-Ulysses' degree (DeepSpeed's key); context_parallel chooses other methods
    sequence_parallel_size: PositiveInt = 1
    data_parallel_size: PositiveInt | None = None  # DeepSpeed's key: checked against the mesh
    context_parallel: ContextParallelConfig = Field(default_factory=ContextParallelConfig)
    # quantization / pruning / layer reduction: meshspeed.compression.init_compression applies
    # it to the model, the engine steps its schedule (docs/compression.md)
    compression_training: CompressionConfig = Field(default_factory=CompressionConfig)
    # meshspeed's own key: compress each gradient bucket of data parallelism (stage 0)
    # before exchanging it, with error feedback (config/gradient_compression.py)
    gradient_compression: GradientCompressionConfig | None = None

    # Set by load_config: which batch keys the user gave (the rest were derived), and
    # the accepted-but-unused DeepSpeed keys that were set aside.
    _batch_given: frozenset[str] | None = PrivateAttr(default=None)
    _ignored_keys: tuple[str, ...] = PrivateAttr(default=())

    @field_validator("steps_per_print", mode="before")
    @classmethod
    def _never(cls, value: Any) -> Any:
        return sys.maxsize if isinstance(value, float) and value == math.inf else value

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_level(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @model_validator(mode="before")
    @classmethod
    def _allreduce_op(cls, data: Any) -> Any:
        # checked here, not per field, so the message names the key once
        if not isinstance(data, dict) or "gradient_allreduce_op" not in data:
            return data
        value = data["gradient_allreduce_op"]
        if not (isinstance(value, str) and value.lower() in ("mean", "sum")):
            raise ValueError(f'Invalid gradient_allreduce_op {show(value)}: use "mean" (average over '
                             'the data-parallel ranks) or "sum"')
        return {**data, "gradient_allreduce_op": value.lower()}

    @model_validator(mode="after")
    def _sum_needs_unsharded_params(self):
        if self.gradient_allreduce_op == "sum" and self.zero_stage == 3:
            raise ValueError('gradient_allreduce_op "sum" is not supported with ZeRO stage 3, as in '
                             'DeepSpeed; use "mean", or ZeRO stage 0-2')
        return self

    @model_validator(mode="after")
    def _one_half_precision(self):
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError(
                "fp16.enabled and bf16.enabled are both true; enable at most one of them"
            )
        return self

    @model_validator(mode="after")
    def _composes(self):
        """Note [one composition table]: the pairs a config alone decides."""
        problems = refusals(config_features(self))
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _one_sequence_degree(self):
        resolve(self.context_parallel, self.sequence_parallel_size)  # raises if they disagree
        return self

    @property
    def sequence(self) -> ContextParallelConfig:
        """The context-parallel method and degree, from either key."""
        return resolve(self.context_parallel, self.sequence_parallel_size)

    @property
    def precision_dtype(self) -> torch.dtype:
        """The dtype parameters and activations train in: bfloat16, float16 or float32."""
        import torch  # lazy: start-up cost (reading a config does not import torch)

        if self.bf16.enabled:
            return torch.bfloat16
        if self.fp16.enabled:
            return torch.float16
        return torch.float32

    @property
    def zero_stage(self) -> int:
        return self.zero_optimization.stage

    @property
    def ignored_keys(self) -> tuple[str, ...]:
        """Dotted paths of DeepSpeed keys that were accepted but are not used."""
        return self._ignored_keys

    @property
    def batch_keys_given(self) -> frozenset[str]:
        """The batch-size keys the user set; the others were derived."""
        if self._batch_given is not None:
            return self._batch_given
        return frozenset(self.model_fields_set & set(BATCH_KEYS))

    # DeepSpeed's `engine.config` is the config dict, and libraries read it as one
    # (transformers' Trainer: `engine.config.get("zero_optimization", {}).get("stage")`); these
    # answer with the values of `to_dict()`, DeepSpeed's key names and JSON values
    def get(self, key: str, default: Any = None) -> Any:
        return self.to_dict().get(key, default)

    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

    def __contains__(self, key: object) -> bool:
        return key in self.to_dict()

    def keys(self):
        return self.to_dict().keys()

    def to_dict(self) -> dict[str, Any]:
        """A plain JSON-able dict of every typed field (for saving in checkpoints).

        Accepted-but-unused keys are not included. `load_config(cfg.to_dict())` gives
        back an equal config.
        """
        return self.model_dump(mode="json")
