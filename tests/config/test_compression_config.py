"""The compression_training section: DeepSpeed's keys and defaults, and one line per mistake."""

import pytest

from meshspeed.compression.compress import compression_config
from meshspeed.config import ConfigError, load_config
from tests.config.helpers import error_of


def _ct(**blocks):
    return {"compression_training": blocks}


def _on(shared=None, groups=None):
    return {"shared_parameters": {"enabled": True, **(shared or {})},
            "different_groups": groups if groups is not None else
            {"g": {"params": {"dense_ratio": 0.5}, "modules": ["fc"]}}}


WQ_GROUP = {"wq1": {"params": {"start_bits": 8, "target_bits": 4}, "modules": ["fc"]}}


def test_defaults_are_deepspeeds():
    cfg = load_config({}).compression_training
    assert not cfg.enabled and cfg.enabled_techniques() == []
    assert cfg.weight_quantization.shared_parameters.schedule_offset == 0
    for name in ("activation_quantization", "sparse_pruning", "row_pruning", "head_pruning",
                 "channel_pruning"):
        assert getattr(cfg, name).shared_parameters.schedule_offset == 1000
    assert cfg.head_pruning.shared_parameters.method == "topk"
    assert cfg.row_pruning.shared_parameters.method == "l1"
    assert cfg.activation_quantization.shared_parameters.range_calibration == "dynamic"
    wq = load_config(_ct(weight_quantization=_on(groups=WQ_GROUP))).compression_training
    assert wq.weight_quantization.different_groups["wq1"].params.quantization_period == 1
    assert wq.enabled_techniques() == ["weight_quantization"]


@pytest.mark.parametrize("blocks, line", [
    (_ct(weight_quantisation={}),
     "compression_training.weight_quantisation: unknown key; did you mean 'weight_quantization'?"),
    (_ct(row_pruning={"shared_parameters": {"enabled": False, "methd": "l1"}}),
     "compression_training.row_pruning.shared_parameters.methd: unknown key; did you mean 'method'?"),
    (_ct(row_pruning=_on({"method": "l2"})),
     ("compression_training.row_pruning.shared_parameters.method: must be one of 'l1' or 'topk' "
     '(got "l2")')),
    (_ct(sparse_pruning=_on({"method": "snip_momentum"})),
     ('compression_training.sparse_pruning.shared_parameters: method "snip_momentum" (Intel Neural '
     'Compressor\'s gradual pruner) is not implemented in meshspeed; use "l1" or "topk"')),
    (_ct(sparse_pruning=_on({"schedule_offset_end": 90})),
     ("compression_training.sparse_pruning.shared_parameters: schedule_offset_end is read by DeepSpeed "
     'only for method "snip_momentum", not "l1" (which prunes from schedule_offset on); remove it')),
    (_ct(sparse_pruning=_on(groups={"g": {"params": {"dense_ratio": 0.5}, "modules": ["a"],
                                          "related_modules": [["b"]]}})),
     ("compression_training.sparse_pruning: different_groups.g.related_modules: only row_pruning, "
     "head_pruning and channel_pruning shrink related layers; remove it")),
    (_ct(head_pruning=_on()),
     ("compression_training.head_pruning.shared_parameters: num_heads is required when head pruning "
     "is enabled (the number of attention heads feeding the pruned output matrix)")),
    (_ct(channel_pruning=_on(groups={})),
     ("compression_training.channel_pruning: channel_pruning is enabled but different_groups is "
     "empty; add a group with params and modules, or set enabled false")),
    (_ct(row_pruning=_on(groups={"g": {"params": {"dense_ratio": 0}, "modules": ["a"]}})),
     "compression_training.row_pruning.different_groups.g.params.dense_ratio: must be > 0.0 (got 0)"),
    (_ct(row_pruning=_on(groups={"g": {"params": {"dense_ratio": 0.5}}})),
     "compression_training.row_pruning.different_groups.g.modules: is required"),
    (_ct(activation_quantization=_on(groups={"g": {"params": {"bits": 6}, "modules": ["a"]}})),
     ("compression_training.activation_quantization.different_groups.g.params.bits: must be one of "
     "4 or 8 (got 6)")),
    (_ct(weight_quantization=_on({"quantization_type": "asymmetric"}, groups={
        "g": {"params": {"start_bits": 8, "target_bits": 2}, "modules": ["a"]}})),
     ('compression_training.weight_quantization: different_groups.g: target_bits 2 (ternary/binary) '
     'needs quantization_type "symmetric" and rounding "nearest", as in DeepSpeed')),
    (_ct(weight_quantization=_on({"quantize_weight_in_forward": True, "rounding": "stochastic"},
                                 groups=WQ_GROUP)),
     ('compression_training.weight_quantization.shared_parameters: rounding "stochastic" applies only '
     "with quantize_weight_in_forward false (DeepSpeed rounds to nearest in the forward); set one of "
     "them")),
    (_ct(layer_reduction={"enabled": True, "keep_number_layer": 2}),
     ("compression_training.layer_reduction: layer_reduction is enabled but module_name_prefix, "
     "teacher_layer are missing")),
])
def test_each_mistake_is_one_line(blocks, line):
    assert error_of(blocks) == line
    with pytest.raises(ConfigError) as info:  # init_compression reads the same block the same way
        compression_config(blocks)
    assert str(info.value) == line


def test_init_compression_reads_only_its_block():
    # other keys of a DeepSpeed config (even ones meshspeed would refuse) are not its business
    cfg = compression_config({"train_batch_size": 7, "zero_optimization": {"stage": 9},
                              "compression_training": {"row_pruning": _on()}})
    assert cfg.enabled_techniques() == ["row_pruning"]
    assert not compression_config({}).enabled
    with pytest.raises(ConfigError, match="must be a path to a JSON file or a dict"):
        compression_config(3)
