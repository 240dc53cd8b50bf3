"""The typed observability blocks: DeepSpeed's keys load, anything else is refused."""

import pytest

from meshspeed.config import ConfigError, load_config


def test_deepspeed_blocks_load_with_their_defaults():
    cfg = load_config({
        "flops_profiler": {"enabled": True, "profile_step": 3, "module_depth": 2, "top_modules": 2,
                           "detailed": False, "output_file": "p.txt"},
        "tensorboard": {"enabled": False, "output_path": "logs/", "job_name": "run1"},
        "csv_monitor": {"enabled": True},
        "wandb": {"enabled": False, "team": "t", "group": "g", "project": "p"},
        "wall_clock_breakdown": True,
    })
    assert cfg.flops_profiler.profile_step == 3 and cfg.flops_profiler.output_file == "p.txt"
    assert cfg.csv_monitor.job_name == "DeepSpeedJobName" and cfg.csv_monitor.output_path == ""
    assert cfg.tensorboard.job_name == "run1" and cfg.wandb.team == "t"
    assert cfg.wall_clock_breakdown and cfg.ignored_keys == ()


@pytest.mark.parametrize("config, says", [
    ({"flops_profiler": {"enabled": True, "profile_stp": 1}}, "profile_step"),
    ({"flops_profiler": {"module_depth": -2}}, "module_depth"),
    ({"csv_monitor": {"enabled": True, "outputpath": "x"}}, "output_path"),
    ({"wandb": {"entity": "x"}}, "wandb.entity"),
])
def test_a_wrong_key_or_value_is_named(config, says):
    with pytest.raises(ConfigError) as err:
        load_config(config)
    assert says in str(err.value)
