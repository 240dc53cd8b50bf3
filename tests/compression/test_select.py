"""Module patterns are matched as DeepSpeed does (re.search); bad ones are one clear error."""

import pytest
import torch

from meshspeed.compression import init_compression, redundancy_clean
from meshspeed.compression.select import match
from meshspeed.config import ConfigError
from tests.compression.models import config, gpt, group, mlp, technique

torch.set_num_threads(1)


def _sparse(*modules, **shared):
    return config(sparse_pruning=technique({"schedule_offset": 0, **shared},
                                           {"sp1": group(list(modules), dense_ratio=0.5)}))


def _error(model, cfg, **kwargs) -> str:
    with pytest.raises((ConfigError, ValueError)) as info:
        init_compression(model, cfg, **kwargs)
    return str(info.value)


def test_patterns_are_regular_expressions_searched_in_module_names():
    model = gpt()
    assert match(model, "wq", (torch.nn.Linear,), "x") == ["layers.0.attn.wq", "layers.1.attn.wq"]
    assert match(model, r"layers\.1\..*w[13]$", (torch.nn.Linear,), "x") == [
        "layers.1.mlp.w1", "layers.1.mlp.w3"]
    # non-layers (blocks, norms) are skipped, as in DeepSpeed, so "layers.0" names its Linears
    assert len(match(model, "layers.0", (torch.nn.Linear,), "x")) == 7


def test_a_pattern_that_matches_nothing_names_itself_and_real_names():
    msg = _error(mlp(), _sparse("fc3"))
    assert msg == ("compression_training.sparse_pruning.different_groups.sp1.modules[0]: 'fc3' "
                   "matches no Linear or Conv2d layer; patterns are regular expressions searched in "
                   "module names such as '0', '2'")


def test_bad_regex_wrong_kind_and_duplicates():
    assert "'(' is not a regular expression" in _error(mlp(), _sparse("("))
    msg = _error(gpt(), _sparse("emb"))
    assert msg.endswith("'emb' names tok_emb (Embedding), which this technique does not apply to "
                        "(only Linear or Conv2d); narrow the pattern")
    cfg = config(sparse_pruning=technique({"schedule_offset": 0}, {
        "a": group(["wq"], dense_ratio=0.5), "b": group([r"attn\.w"], dense_ratio=0.5)}))
    assert "layers.0.attn.wq is already named by group 'a' of sparse_pruning" in _error(gpt(), cfg)


def test_related_layers_must_pair_one_to_one():
    cfg = config(row_pruning=technique({"schedule_offset": 0}, {
        "rp": group([r"mlp\.w1"], related=[["w2"]], dense_ratio=0.5)}))
    init_compression(gpt(), cfg)  # two w1 and two w2: layers.0.mlp.w1 with layers.0.mlp.w2, ...
    cfg = config(row_pruning=technique({"schedule_offset": 0}, {
        "rp": group([r"layers\.0\.mlp\.w1"], related=[["w2"]], dense_ratio=0.5)}))
    assert "'w2' names 2 layers and modules[0] names 1" in _error(gpt(), cfg)


def test_layer_shapes_mpu_and_teacher_are_checked():
    cfg = config(head_pruning=technique({"schedule_offset": 0, "num_heads": 3},
                                        {"hp": group([r"attn\.wo"], dense_ratio=0.5)}))
    assert "32 inputs, which do not split into 3 heads" in _error(gpt(), cfg)
    cfg = config(weight_quantization=technique({"quantize_groups": 3},
                                               {"wq": group(["^0$"], start_bits=8, target_bits=8)}))
    assert "quantize_groups: 3 does not divide the 128 weights of 0" in _error(mlp(), cfg)
    assert "mpu" in _error(mlp(), _sparse("0"), mpu=object())
    cfg = config(layer_reduction={"enabled": True, "keep_number_layer": 1,
                                  "module_name_prefix": "layers", "teacher_layer": [1]})
    assert "needs teacher_model=" in _error(gpt(n_layer=1), cfg)


def test_redundancy_clean_needs_the_prepared_model():
    with pytest.raises(ConfigError, match="has no sparse_pruning to clean up"):
        redundancy_clean(mlp(), _sparse("0"))
