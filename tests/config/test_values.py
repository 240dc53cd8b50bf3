"""Types, ranges, choices and cross-field rules, each error naming its key."""

import pytest
import torch

from meshspeed.config import (
    ConfigError,
    FP16Config,
    MeshspeedConfig,
    ZeroConfig,
    load_config,
)
from tests.config.helpers import error_of


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (
            {"zero_optimization": {"stage": 4}},
            "zero_optimization.stage: must be one of 0, 1, 2 or 3 (got 4)",
        ),
        (
            {"zero_optimization": {"stage": "3"}},
            'zero_optimization.stage: must be one of 0, 1, 2 or 3 (got "3")',
        ),
        (
            {"zero_optimization": {"stage": True}},
            "zero_optimization.stage: expected an integer, not true/false (got true)",
        ),
        (
            {"zero_optimization": {"reduce_bucket_size": -1}},
            "zero_optimization.reduce_bucket_size: must be >= 0 (got -1)",
        ),
        (
            {"zero_optimization": {"reduce_bucket_size": 1.5}},
            "zero_optimization.reduce_bucket_size: expected an integer (got 1.5)",
        ),
        ({"zero_optimization": 2}, "zero_optimization: expected an object ({...}) (got 2)"),
        (
            {"zero_optimization": {"offload_param": {"device": "gpu"}}},
            (
                "zero_optimization.offload_param.device: "
                "must be one of 'none', 'cpu' or 'nvme' (got \"gpu\")"
            ),
        ),
        ({"fp16": {"enabled": 1}}, "fp16.enabled: expected true or false (got 1)"),
        ({"fp16": {"loss_scale": -1}}, "fp16.loss_scale: must be >= 0.0 (got -1)"),
        ({"gradient_clipping": "1.0"}, 'gradient_clipping: expected a number (got "1.0")'),
        ({"steps_per_print": 0}, "steps_per_print: must be >= 1 (got 0)"),
        (
            {"communication_data_type": "int8"},
            "communication_data_type: must be one of 'fp32', 'fp16' or 'bf16' (got \"int8\")",
        ),
        (
            {"checkpoint": {"tag_validation": "loud"}},
            "checkpoint.tag_validation: must be one of 'Ignore', 'Warn' or 'Fail' (got \"loud\")",
        ),
        (
            {"comms_logger": {"prof_ops": "all_reduce"}},
            'comms_logger.prof_ops: expected a list (got "all_reduce")',
        ),
        ({"optimizer": {"params": {"lr": 1e-3}}}, "optimizer.type: is required"),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
            'zero_optimization.offload_optimizer: nvme_path is required when device is "nvme"',
        ),
    ],
)
def test_type_and_range_errors_name_key_value_and_allowed(config, expected):
    assert error_of(config) == expected


def test_float_for_int_when_integral():
    cfg = load_config(
        {
            "zero_optimization": {
                "stage": 3.0,
                "reduce_bucket_size": 5e8,
                "sub_group_size": 1e9,
                "offload_param": {"device": "cpu", "buffer_size": 1e8},
            }
        }
    )
    zero = cfg.zero_optimization
    assert zero.stage == 3 and type(zero.stage) is int
    assert zero.reduce_bucket_size == 500_000_000 and type(zero.reduce_bucket_size) is int
    assert zero.sub_group_size == 1_000_000_000
    assert zero.offload_param.buffer_size == 100_000_000


def test_fp16_and_bf16_both_enabled_is_an_error():
    msg = error_of({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert "fp16.enabled and bf16.enabled are both true" in msg


@pytest.mark.parametrize("spelling", ["adam", "ADAM", "Adam"])
def test_optimizer_type_case_insensitive_keeps_canonical_spelling(spelling):
    cfg = load_config({"optimizer": {"type": spelling, "params": {"lr": 1e-3}}})
    assert cfg.optimizer.type == "Adam"
    assert cfg.optimizer.params == {"lr": 1e-3}
    assert load_config({"optimizer": {"type": "adamw"}}).optimizer.type == "AdamW"
    assert load_config({"optimizer": {"type": "sgd"}}).optimizer.type == "SGD"


def test_deepspeed_only_optimizer_says_what_is_supported():
    msg = error_of({"optimizer": {"type": "Lamb"}})
    assert msg.startswith("optimizer.type: a DeepSpeed optimizer meshspeed does not implement")
    assert "supported types: Adam, AdamW, SGD, OneBitAdam, ZeroOneAdam, OneBitLamb" in msg
    assert load_config({"optimizer": {"type": "onebitlamb"}}).optimizer.type == "OneBitLamb"
    assert load_config({"optimizer": {"type": "onebitadam"}}).optimizer.type == "OneBitAdam"
    assert "did you mean 'Adam'" in error_of({"optimizer": {"type": "Adma"}})


def test_scheduler_types():
    cfg = load_config({"scheduler": {"type": "warmupcosinelr", "params": {"warmup_num_steps": 10}}})
    assert cfg.scheduler.type == "WarmupCosineLR"
    assert load_config({"scheduler": {"type": "onecycle"}}).scheduler.type == "OneCycle"
    assert load_config({"scheduler": {"type": "LRRangeTest"}}).scheduler.type == "LRRangeTest"
    msg = error_of({"scheduler": {"type": "OneCycleLR"}})
    assert "did you mean 'OneCycle'" in msg
    assert "WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest" in msg


def test_communication_dtype_accepts_torch_names():
    assert load_config({"communication_data_type": "bfloat16"}).communication_data_type == "bf16"
    assert load_config({"communication_data_type": "float32"}).communication_data_type == "fp32"
    assert load_config({"communication_data_type": "fp16"}).communication_data_type == "fp16"
    assert load_config({}).communication_data_type is None


def test_precision_dtype_and_zero_stage():
    assert load_config({}).precision_dtype == torch.float32
    assert load_config({"fp16": {"enabled": True}}).precision_dtype == torch.float16
    assert load_config({"bf16": {"enabled": True}}).precision_dtype == torch.bfloat16
    assert load_config({"zero_optimization": {"stage": 2}}).zero_stage == 2


def test_deepspeed_defaults():
    cfg = load_config({})
    assert cfg.gradient_clipping == 0.0 and cfg.steps_per_print == 10 and cfg.optimizer is None
    assert cfg.fp16 == FP16Config()
    assert (cfg.fp16.loss_scale, cfg.fp16.initial_scale_power, cfg.fp16.loss_scale_window) == (
        0,
        16,
        1000,
    )
    assert (cfg.fp16.hysteresis, cfg.fp16.min_loss_scale) == (2, 1)
    assert cfg.zero_optimization == ZeroConfig()
    zero = cfg.zero_optimization
    assert zero.stage == 0 and zero.reduce_bucket_size == 500_000_000
    assert zero.stage3_prefetch_bucket_size == 50_000_000
    assert zero.stage3_param_persistence_threshold == 0  # meshspeed default (see config/zero.py)
    assert cfg.checkpoint.tag_validation == "Warn"
    assert (cfg.aio.block_size, cfg.aio.queue_depth, cfg.aio.thread_count) == (1048576, 8, 1)


def test_models_are_frozen():
    cfg = load_config({})
    with pytest.raises(Exception, match="frozen"):
        cfg.train_batch_size = 7
    with pytest.raises(Exception, match="frozen"):
        cfg.zero_optimization.stage = 3


def test_direct_construction_checks_types_with_key_paths():
    with pytest.raises(ConfigError, match=r"^zero_optimization.stage: must be one of"):
        MeshspeedConfig.checked({"zero_optimization": {"stage": 5}})
