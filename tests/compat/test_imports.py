"""Every `deepspeed.*` name that the surveyed client scripts use imports through the alias.

Survey (DeepSpeedExamples: training/cifar/cifar10_deepspeed.py and its MoE run,
training/HelloDeepSpeed/train_bert_ds.py, training/pipeline_parallelism/train.py,
DeepSpeed-Chat dschat/utils/{utils,ds_utils}.py, dschat/utils/module/lora.py,
dschat/rlhf/*.py, training/step1_supervised_finetuning/main.py; DeepSpeed
docs/_tutorials/{getting-started,zero,zero-offload}.md). Module -> names imported or
reached as attributes. Scripts that write `import meshspeed as deepspeed` reach the same
modules as `meshspeed.*` (Note [DeepSpeed's paths] in meshspeed/compat/paths.py), except
`deepspeed.comm`, which there is meshspeed's collectives without DeepSpeed's process-group
life cycle (`init_distributed` is `meshspeed.init_distributed`).
"""

from __future__ import annotations

import importlib
import sys

import pytest

SURVEY = {
    "deepspeed": ["initialize", "init_distributed", "add_config_arguments", "get_accelerator",
                  "zero", "comm", "runtime", "moe", "pipe", "ops", "utils", "accelerator",
                  "compression", "PipelineModule", "checkpointing"],
    "deepspeed.accelerator": ["get_accelerator"],
    "deepspeed.comm": ["get_rank", "get_world_size", "barrier", "all_reduce", "init_distributed",
                       "is_initialized", "ReduceOp"],
    "deepspeed.zero": ["GatheredParameters", "Init"],
    "deepspeed.utils": ["RepeatingLoader", "logger", "log_dist"],
    "deepspeed.utils.zero_to_fp32": ["get_fp32_state_dict_from_zero_checkpoint",
                                     "convert_zero_checkpoint_to_fp32_state_dict",
                                     "load_state_dict_from_zero_checkpoint"],
    "deepspeed.runtime.utils": ["set_random_seed", "see_memory_usage"],
    "deepspeed.pipe": ["PipelineModule", "LayerSpec", "TiedLayerSpec", "ProcessTopology",
                       "PipeDataParallelTopology", "PipeModelDataParallelTopology"],
    "deepspeed.runtime.pipe": ["PipelineModule", "LayerSpec", "TiedLayerSpec", "ProcessTopology"],
    "deepspeed.runtime.pipe.module": ["PipelineModule", "LayerSpec", "TiedLayerSpec"],
    "deepspeed.runtime.pipe.topology": ["ProcessTopology", "PipeDataParallelTopology",
                                        "PipeModelDataParallelTopology"],
    "deepspeed.moe.utils": ["split_params_into_different_moe_groups_for_optimizer", "is_moe_param"],
    "deepspeed.moe.layer": ["MoE"],
    "deepspeed.ops.adam": ["FusedAdam", "DeepSpeedCPUAdam"],
    "deepspeed.compression.helper": ["recursive_getattr", "recursive_setattr"],
    # DeepSpeedExamples compression/bert/run_glue_no_trainer.py, compression/gpt2
    "deepspeed.compression": ["init_compression", "redundancy_clean", "compression_scheduler",
                              "convert_conv1d_to_linear"],
    "deepspeed.compression.compress": ["init_compression", "redundancy_clean"],
    "deepspeed.compression.scheduler": ["compression_scheduler"],
    # Megatron-DeepSpeed's megatron/training.py and model/transformer.py; DeepSpeedExamples' Megatron
    "deepspeed.checkpointing": ["checkpoint", "configure", "is_configured", "reset",
                                "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed"],
    "deepspeed.runtime.activation_checkpointing.checkpointing": ["checkpoint", "configure",
                                                                 "get_cuda_rng_tracker"],
    "deepspeed.runtime.zero.partition_parameters": ["ZeroParamStatus"],  # DeepSpeed-Chat utils
}


@pytest.fixture(scope="module", autouse=True)
def alias():
    """`import deepspeed` is meshspeed here, as under `meshspeed run --deepspeed-compat`."""
    from meshspeed.compat.alias import install, uninstall

    install()
    yield
    uninstall()

# Surveyed names another piece of the drop-in work provides; checked once they are there.
ELSEWHERE = {
    "deepspeed.runtime.zero.partition_parameters": ["ZeroParamStatus"],  # DeepSpeed-Chat utils
}

# The accelerator methods the surveyed scripts call (and their close relatives).
ACCELERATOR_METHODS = [
    "device_name", "current_device_name", "current_device", "is_available", "device_count",
    "set_device", "manual_seed", "manual_seed_all", "initial_seed", "synchronize", "empty_cache",
    "is_bf16_supported", "is_fp16_supported", "supported_dtypes", "communication_backend_name",
    "pin_memory", "is_pinned", "on_accelerator", "memory_allocated", "max_memory_allocated",
    "reset_peak_memory_stats", "memory_reserved", "max_memory_reserved", "total_memory",
    "available_memory", "memory_stats", "range_push", "range_pop",
]


@pytest.mark.parametrize("module", sorted(SURVEY))
def test_surveyed_names_import(module):
    mod = importlib.import_module(module)
    missing = [name for name in SURVEY[module] if not hasattr(mod, name)]
    assert not missing, f"{module} lacks {missing}"
    # `from package import submodule` works as well as `import package.submodule`
    parent, _, leaf = module.rpartition(".")
    if parent:
        exec(f"from {parent} import {leaf} as _m", {})  # noqa: S102 - the statement under test
        assert getattr(sys.modules[parent], leaf) is mod


def test_packages_reach_submodules_as_attributes():
    """Scripts write `deepspeed.runtime.utils.set_random_seed(...)` or
    `deepspeed.moe.layer.MoE(...)` after nothing but `import deepspeed`."""
    import meshspeed

    assert callable(meshspeed.runtime.utils.set_random_seed)
    assert meshspeed.moe.layer.MoE.__name__ == "MoE"
    assert meshspeed.runtime.pipe.PipelineModule is meshspeed.pipe.PipelineModule
    assert meshspeed.accelerator.get_accelerator is meshspeed.get_accelerator
    assert not hasattr(meshspeed.runtime, "no_such_submodule")


def test_accelerator_has_deepspeed_methods():
    import torch
    from meshspeed.accelerator import get_accelerator

    acc = get_accelerator()
    assert [m for m in ACCELERATOR_METHODS if not callable(getattr(acc, m, None))] == []
    # torch.device(acc.device_name(), local_rank) is how the tutorials build the device
    name = acc.device_name()
    assert ":" not in name and torch.device(name, 0).type == acc.name
    assert acc.device_name(0) == ("cpu" if acc.name == "cpu" else "cuda:0")
    assert acc.on_accelerator(torch.ones(1, device=acc.current_device_name()))
    assert acc.communication_backend_name() in ("gloo", "nccl")
    assert torch.float32 in acc.supported_dtypes()
    assert acc.total_memory() >= acc.available_memory() > 0
    acc.manual_seed_all(5)
    acc.empty_cache()
    acc.range_push("x")
    acc.range_pop()
