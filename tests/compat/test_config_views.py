"""DeepSpeed's config classes as views of meshspeed's typed config (issue 35):
deepspeed.runtime.config / config_utils / precision_config / zero.config."""

import json

import pytest
import torch
from pydantic import Field, ValidationError

from meshspeed.compat.deepspeed.runtime.config import (
    ADAM_OPTIMIZER,
    ONEBIT_ADAM_OPTIMIZER,
    BatchConfigError,
    DeepSpeedConfig,
    DeepSpeedConfigError,
)
from meshspeed.compat.deepspeed.runtime.config_utils import (
    DeepSpeedConfigModel,
    DeprecatedFieldConflict,
    get_config_default,
)
from meshspeed.compat.deepspeed.runtime.precision_config import (
    DeepSpeedBF16Config,
    DeepSpeedFP16Config,
    get_bfloat16_config,
)
from meshspeed.compat.deepspeed.runtime.zero.config import (
    DeepSpeedZeroConfig,
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
    ZeroStageEnum,
    get_zero_config,
)
from meshspeed.config import ConfigError, FP16Config, ZeroConfig, load_config

DS_DICT = {
    "train_batch_size": 16,
    "gradient_accumulation_steps": 2,
    "steps_per_print": 5,
    "gradient_clipping": 0.5,
    "communication_data_type": "bf16",
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 7}},
    "fp16": {"enabled": True, "loss_scale_window": 200, "initial_scale_power": 8},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000, "prefetch_bucket_size": 77,
                          "offload_optimizer": {"device": "cpu", "pipeline_read": True},
                          "ignore_unused_parameters": False},
}


def test_fields_read_from_a_deepspeed_dict_equal_meshspeeds_parse():
    ds = DeepSpeedConfig(DS_DICT)
    ms = load_config(DS_DICT, dp_world_size=1)
    assert ds.meshspeed_config == ms
    assert (ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps) == (16, 8, 2)
    assert ds.steps_per_print == ms.steps_per_print == 5
    assert ds.gradient_clipping == 0.5
    assert ds.communication_data_type is torch.bfloat16
    assert ds.optimizer_name == ADAM_OPTIMIZER == "adam"
    assert ds.optimizer_params == {"lr": 1e-3, "weight_decay": 0.1}
    assert (ds.scheduler_name, ds.scheduler_params) == ("WarmupLR", {"warmup_num_steps": 7})
    assert ds.fp16_enabled and not ds.bfloat16_enabled
    assert ds.float16_config.loss_scale_window == 200 and ds.float16_config.initial_dynamic_scale() == 256
    assert isinstance(ds.float16_config, FP16Config)
    zero = ds.zero_config
    assert isinstance(zero, DeepSpeedZeroConfig) and isinstance(zero, ZeroConfig)
    assert ds.zero_optimization_stage == zero.stage == ms.zero_stage == 2 and ds.zero_enabled
    for name in ZeroConfig.model_fields:
        if name not in ("offload_optimizer", "offload_param"):
            assert getattr(zero, name) == getattr(ms.zero_optimization, name), name
    assert zero.prefetch_bucket_size == ms.zero_optimization.stage3_prefetch_bucket_size == 77
    # what meshspeed runs, its own defaults included (Note [two sets of ZeRO defaults])
    assert zero.overlap_comm is True and zero.param_persistence_threshold == 0
    # DeepSpeed-only keys the dict gave, at any depth, and their DeepSpeed defaults otherwise
    assert zero.ignore_unused_parameters is False and zero.load_from_fp32_weights is True
    assert isinstance(zero.offload_optimizer, DeepSpeedZeroOffloadOptimizerConfig)
    assert zero.offload_optimizer.pipeline and zero.offload_optimizer.device == "cpu"
    assert zero.offload_optimizer.pin_memory is False  # meshspeed's parse of the missing key


def test_a_json_or_hjson_path_reads_the_same(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DS_DICT))
    from_path = DeepSpeedConfig(str(path))
    assert from_path.meshspeed_config == DeepSpeedConfig(DS_DICT).meshspeed_config
    assert from_path._param_dict == DS_DICT


def test_other_optimizer_names_keep_meshspeeds_spelling():
    ds = DeepSpeedConfig({"train_batch_size": 1, "optimizer": {"type": "onebitadam"}})
    assert ds.optimizer_name == "OneBitAdam" and ONEBIT_ADAM_OPTIMIZER == "onebitadam"
    assert ds.optimizer_params is None  # DeepSpeed: no params key, None
    assert DeepSpeedConfig({"train_batch_size": 1}).optimizer_name is None


def test_batch_rule_and_errors_are_deepspeeds():
    ds = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 3})
    assert (ds.train_batch_size, ds.gradient_accumulation_steps) == (3, 1)
    with pytest.raises(BatchConfigError, match="give train_batch_size or train_micro_batch_size_per_gpu"):
        DeepSpeedConfig({"gradient_accumulation_steps": 2})
    ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps = 8, 3, None
    with pytest.raises(AssertionError, match="not divisible"):  # DeepSpeed callers catch this
        ds._configure_train_batch_size()
    ds.train_batch_size, ds.train_micro_batch_size_per_gpu = 8, 4
    ds._configure_train_batch_size()
    assert ds.gradient_accumulation_steps == 2


def test_config_error_is_deepspeeds_and_a_value_error():
    assert DeepSpeedConfigError is ConfigError and issubclass(DeepSpeedConfigError, ValueError)
    with pytest.raises(DeepSpeedConfigError, match="train_batch_size"):
        DeepSpeedConfig({"train_batch_size": 0})
    with pytest.raises(DeepSpeedConfigError, match="did you mean 'reduce_bucket_size'"):
        DeepSpeedConfig({"train_batch_size": 1, "zero_optimization": {"reduce_bucket_sise": 1}})
    assert issubclass(BatchConfigError, DeepSpeedConfigError) and issubclass(BatchConfigError, AssertionError)


def test_zero_view_has_deepspeeds_defaults_when_built_directly():
    for stage in (0, 1, 2):
        assert DeepSpeedZeroConfig(stage=stage).overlap_comm is False
    assert DeepSpeedZeroConfig(stage=ZeroStageEnum.weights).overlap_comm is True
    z = DeepSpeedZeroConfig()
    assert (z.stage, z.reduce_bucket_size, z.allgather_bucket_size) == (0, 500_000_000, 500_000_000)
    assert (z.prefetch_bucket_size, z.param_persistence_threshold) == (50_000_000, 100_000)
    assert (z.max_live_parameters, z.max_reuse_distance) == (1_000_000_000, 1_000_000_000)
    assert z.gather_16bit_weights_on_model_save is False and z.pipeline_loading_checkpoint is False
    assert z.offload_param is None and z.offload_optimizer is None
    z = DeepSpeedZeroConfig(offload_param={}, offload_optimizer={})
    assert isinstance(z.offload_param, DeepSpeedZeroOffloadParamConfig)
    assert z.offload_param.pin_memory and z.offload_optimizer.pin_memory  # DeepSpeed pins by default
    assert (z.offload_param.buffer_count, z.offload_optimizer.buffer_count) == (5, 4)
    assert get_zero_config({"zero_optimization": True}).stage == 1  # DeepSpeed's oldest form


def test_zero_view_takes_deepspeeds_spellings():
    assert DeepSpeedZeroConfig(stage3_prefetch_bucket_size=123).prefetch_bucket_size == 123
    assert DeepSpeedZeroConfig(prefetch_bucket_size=124).stage3_prefetch_bucket_size == 124
    assert DeepSpeedZeroConfig(stage3_gather_fp16_weights_on_model_save=True).gather_16bit_weights_on_model_save
    assert DeepSpeedZeroConfig(stage3_model_persistence_threshold=9).model_persistence_threshold == 9
    assert DeepSpeedZeroConfig(cpu_offload=True).offload_optimizer.device == "cpu"
    assert isinstance(DeepSpeedZeroConfig(cpu_offload_param=True).offload_param, DeepSpeedZeroOffloadParamConfig)
    assert DeepSpeedZeroConfig(reduce_bucket_size="auto").reduce_bucket_size == 500_000_000
    assert DeepSpeedZeroConfig(reduce_bucket_size="1000").reduce_bucket_size == 1000  # lax, as DeepSpeed


@pytest.mark.parametrize("bad", [
    {"stage": 7}, {"reduce_bucket_sise": 1}, {"reduce_bucket_size": -1},
    {"compute_grad_norm": False, "stage": 3},
    {"offload_optimizer": {"ratio": 0.5}, "stage": 2},
    {"prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 2},
])
def test_zero_view_rejects_what_deepspeed_rejects(bad):
    with pytest.raises(ValidationError):
        DeepSpeedZeroConfig(**bad)


def test_zero_view_validates_assignment():
    z = DeepSpeedZeroConfig()
    z.stage = 3
    assert z.stage == 3
    with pytest.raises(ValidationError):
        z.stage = 4


def test_precision_views():
    f = DeepSpeedFP16Config()
    assert (f.enabled, f.loss_scale, f.initial_scale_power, f.loss_scale_window, f.hysteresis,
            f.min_loss_scale, f.fp16_master_weights_and_grads) == (False, 0, 16, 1000, 2, 1, False)
    assert DeepSpeedFP16Config(loss_scale="3").loss_scale == 3.0
    for bad in (-1, float("inf"), float("nan"), True, [], {}):
        with pytest.raises(ValidationError):
            DeepSpeedFP16Config(loss_scale=bad)
    with pytest.raises(ValidationError, match="must be a number"):
        DeepSpeedFP16Config(loss_scale=[])
    b = DeepSpeedBF16Config()
    assert (b.enabled, b.immediate_grad_update, b.check_grad_overflow) == (False, False, True)
    assert get_bfloat16_config({"bfloat16": {"enabled": True}}).enabled
    assert get_bfloat16_config({"bf16": {"enabled": True}, "bfloat16": {"enabled": False}}).enabled


class _Conf(DeepSpeedConfigModel):
    count: int = 0
    names_old: str | None = Field(None, json_schema_extra={
        "deprecated": True, "new_param": "names", "new_param_fn": lambda x: [x]})
    names: list[str] | None = None
    size: int = Field(0, alias="size_alias")


def test_config_model_rules():
    assert _Conf(count="4").count == 4
    assert _Conf(names_old="a").names == ["a"]
    assert _Conf(size_alias=3).size == 3 and _Conf(size=5).size == 5
    assert _Conf(count="auto").count == 0
    with pytest.raises(ValidationError):
        _Conf(count="auto", strict=True)
    with pytest.raises(DeprecatedFieldConflict, match="names_old is the deprecated spelling of names"):
        _Conf(names=["a"], names_old="b")
    for bad in ({"count": "x"}, {"names": "a"}, {"typo": 1}):
        with pytest.raises(ValidationError):
            _Conf(**bad)
    assert get_config_default(_Conf, "count") == 0
    with pytest.raises(ConfigError, match="'nope' is not a field"):
        get_config_default(_Conf, "nope")


def test_top_level_names():
    import meshspeed.compat.deepspeed as ds_top

    assert ds_top.DeepSpeedConfigError is ConfigError and ds_top.DeepSpeedConfig is DeepSpeedConfig
    assert ds_top.__git_branch__ == "meshspeed" and ds_top.__git_hash__.startswith("meshspeed-")


def test_deepspeed_io_shards_like_initialize():
    from meshspeed.compat.api import initialize
    from meshspeed.compat.deepspeed.runtime.engine import DeepSpeedEngine

    model = torch.nn.Linear(3, 3)
    engine, *_ = initialize(model=model, config={"train_batch_size": 4, "optimizer": {"type": "SGD",
                                                                                     "params": {"lr": 0.1}}})
    assert isinstance(engine, DeepSpeedEngine)
    data = torch.utils.data.TensorDataset(torch.arange(10.0).reshape(10, 1))
    loader = engine.deepspeed_io(data)
    batches = [b[0].flatten().tolist() for b in loader]
    assert [len(b) for b in batches] == [4, 4]  # the config's micro batch; the short last one dropped
    assert len({x for b in batches for x in b}) == 8  # distinct samples of the one rank's shard
    assert [len(b[0]) for b in engine.deepspeed_io(data, batch_size=5)] == [5, 5]
    with pytest.raises(NotImplementedError, match="data_sampler"):
        engine.deepspeed_io(data, data_sampler=torch.utils.data.SequentialSampler(data))


def test_zero3_elastic_checkpoint_warns_that_it_is_deprecated(caplog):
    from meshspeed.compat.deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    with caplog.at_level("WARNING", logger="meshspeed"):
        DeepSpeedZeroConfig(stage=2, elastic_checkpoint=True)
        assert not caplog.records
        DeepSpeedZeroConfig(stage=3, elastic_checkpoint=True)
    assert "elastic checkpointing is deprecated" in caplog.text
