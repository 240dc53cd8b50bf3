"""load_config inputs: None, dict, JSON path, MeshspeedConfig; a realistic DeepSpeed config."""

import json
import logging

import pytest

from meshspeed.config import ConfigError, MeshspeedConfig, load_config

REALISTIC_ZERO3 = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "steps_per_print": 100,
    "gradient_clipping": 1.0,
    "wall_clock_breakdown": False,
    "prescale_gradients": False,
    "communication_data_type": "fp32",
    "bf16": {"enabled": True},
    "fp16": {"enabled": False, "loss_scale": 0, "initial_scale_power": 16},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": 0,
            "warmup_max_lr": 3e-4,
            "warmup_num_steps": 500,
            "total_num_steps": 10000,
        },
    },
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e8,
        "sub_group_size": 1e9,
        "stage3_prefetch_bucket_size": 5e7,
        "stage3_param_persistence_threshold": 1e6,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
        "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": 1.0},
        "offload_param": {
            "device": "nvme",
            "nvme_path": "/local_nvme",
            "pin_memory": True,
            "buffer_count": 5,
            "buffer_size": 1e8,
            "max_in_cpu": 1e9,
        },
        "ignore_unused_parameters": True,
        "zero_quantized_weights": False,
    },
    "aio": {
        "block_size": 1048576,
        "queue_depth": 8,
        "thread_count": 1,
        "single_submit": False,
        "overlap_events": True,
    },
    "activation_checkpointing": {
        "partition_activations": False,
        "cpu_checkpointing": True,
        "contiguous_memory_optimization": False,
        "number_checkpoints": None,
        "profile": False,
    },
    "comms_logger": {"enabled": True, "prof_all": False, "prof_ops": ["all_reduce"]},
    "checkpoint": {"tag_validation": "Fail", "parallel_write": {"pipeline_stage": False}},
    "tensorboard": {"enabled": True, "output_path": "logs/", "job_name": "zero3"},
    "flops_profiler": {"enabled": False, "profile_step": 1},
    "zero_allow_untested_optimizer": True,
}


def test_realistic_zero3_offload_bf16_config_loads(caplog):
    with caplog.at_level(logging.INFO, logger="meshspeed"):
        cfg = load_config(REALISTIC_ZERO3, dp_world_size=8, dp_source="WORLD_SIZE=8 from torchrun")
    assert cfg.zero_stage == 3
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert cfg.zero_optimization.offload_param.nvme_path == "/local_nvme"
    assert cfg.zero_optimization.stage3_param_persistence_threshold == 1_000_000
    assert cfg.bf16.enabled and not cfg.fp16.enabled
    assert cfg.optimizer.params["betas"] == [0.9, 0.95]
    assert cfg.scheduler.type == "WarmupDecayLR"
    assert cfg.comms_logger.prof_ops == ["all_reduce"]
    assert cfg.checkpoint.tag_validation == "Fail"
    assert cfg.tensorboard.enabled and cfg.tensorboard.job_name == "zero3"
    assert cfg.flops_profiler.profile_step == 1 and not cfg.flops_profiler.enabled
    assert set(cfg.ignored_keys) == {"zero_allow_untested_optimizer"}
    assert cfg.zero_optimization.ignore_unused_parameters is True  # read: engine/unused.py
    assert sum("accepted but not used" in r.getMessage() for r in caplog.records) == 1


def test_json_file_path(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(REALISTIC_ZERO3))
    from_str = load_config(str(path), dp_world_size=8, dp_source="test")
    from_path = load_config(path, dp_world_size=8, dp_source="test")
    assert from_str == from_path
    assert from_path.zero_optimization.reduce_bucket_size == 500_000_000


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text('{\n  "train_batch_size": 8,\n  "steps" }}')  # neither JSON nor HJSON
    with pytest.raises(ConfigError, match="not valid JSON: .* line 3"):
        load_config(broken)
    twice = tmp_path / "twice.json"
    twice.write_text('{"fp16": {"enabled": true, "enabled": false}}')
    with pytest.raises(ConfigError, match="'enabled' appears twice"):
        load_config(twice)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        load_config(listed)


def test_none_and_wrong_input_type():
    assert load_config(None) == load_config({})
    with pytest.raises(ConfigError, match="got list"):
        load_config([1, 2])


def test_input_dict_is_not_modified():
    raw = {"bfloat16": {"enabled": True}, "zero_optimization": {"stage": 1, "cpu_offload": True}}
    snapshot = json.dumps(raw, sort_keys=True)
    load_config(raw)
    assert json.dumps(raw, sort_keys=True) == snapshot


def test_to_dict_is_json_and_round_trips():
    cfg = load_config(REALISTIC_ZERO3, dp_world_size=8, dp_source="test")
    data = cfg.to_dict()
    assert json.loads(json.dumps(data)) == data
    again = load_config(data, dp_world_size=8, dp_source="test")
    assert again.to_dict() == data  # `==` also compares ignored_keys, which to_dict drops
    assert isinstance(again, MeshspeedConfig)
