"""The `pipeline` block: DeepSpeed's keys plus `schedule`, `virtual_stages` and
`activation_compression`."""

import pytest

from meshspeed.config import ConfigError, load_config

BASE = {"train_micro_batch_size_per_gpu": 1}


def test_deepspeeds_block_loads_with_its_auto():
    cfg = load_config({**BASE, "pipeline": {"stages": "auto", "partition": "best", "seed_layers": False,
                                            "activation_checkpoint_interval": 0, "pipe_partitioned": True,
                                            "grad_partitioned": True}})
    assert cfg.pipeline.stages == "auto" and cfg.pipeline.schedule == "1f1b"
    assert load_config(cfg.to_dict()).pipeline == cfg.pipeline


def test_schedule_and_virtual_stages():
    cfg = load_config({**BASE, "pipeline": {"schedule": "zb-h1", "virtual_stages": 2}})
    assert (cfg.pipeline.schedule, cfg.pipeline.virtual_stages) == ("zb-h1", 2)


def test_activation_compression():
    assert load_config(BASE).pipeline.activation_compression == "none"
    for mode in ("none", "bf16", "int8"):
        cfg = load_config({**BASE, "pipeline": {"activation_compression": mode}})
        assert cfg.pipeline.activation_compression == mode and load_config(cfg.to_dict()).pipeline == cfg.pipeline


@pytest.mark.parametrize("block,needle", [({"schedule": "zb-h2"}, "pipeline.schedule"),
                                          ({"virtual_stages": 0}, "pipeline.virtual_stages"),
                                          ({"stage": 2}, "pipeline.stage"),
                                          ({"activation_compression": "fp8"},
                                           "pipeline.activation_compression: must be one of 'none', 'bf16' or 'int8'")])
def test_bad_pipeline_values_are_named(block, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config({**BASE, "pipeline": block})
