"""The one composition table (meshspeed/config/composition.py), walked pair by pair: every
pair of features either composes or is refused with its own sentence, naming both."""

from __future__ import annotations

import itertools

import pytest

from meshspeed.config import ConfigError, load_config
from meshspeed.config.composition import FEATURES, RULES, check, config_features, refusals

PAIRS = list(itertools.combinations(sorted(FEATURES), 2))


def test_every_rule_names_known_features():
    assert {f for pair in RULES for f in pair} <= set(FEATURES)


@pytest.mark.parametrize(("a", "b"), PAIRS, ids=lambda x: x)
def test_each_pair_composes_or_says_why(a, b):
    active = {a: f"<{a}>", b: f"<{b}>"}
    refused = (a, b) in RULES or (b, a) in RULES
    problems = refusals(active)
    if not refused:
        assert problems == []
        check(active)  # no error
        return
    assert len(problems) == 1
    sentence = problems[0]
    assert f"<{a}>" in sentence and f"<{b}>" in sentence, sentence  # both features are named
    with pytest.raises(ConfigError) as err:
        check(active)
    assert err.value.problems == [sentence]


def test_an_unknown_feature_is_a_programming_error():
    with pytest.raises(ValueError, match="unknown composition features"):
        refusals({"warp_drive": "?"})


@pytest.mark.parametrize(("config", "fragment"), [
    ({"zero_optimization": {"stage": 2}, "gradient_compression": {"method": "int8"}},
     "gradient_compression: runs with data parallelism"),
    ({"fp16": {"enabled": True}, "gradient_compression": {"method": "int8"}}, "loss scale"),
    ({"optimizer": {"type": "OneBitAdam", "params": {}}, "bf16": {"enabled": True}}, "fp32 only"),
    ({"tensor_parallel": {"autotp_size": 2, "sequence_parallel": True}, "sequence_parallel_size": 2},
     "both split the sequence"),
])
def test_a_config_alone_is_refused_when_it_parses(config, fragment):
    """Pairs a config decides by itself are refused by load_config, before anything runs."""
    with pytest.raises(ConfigError, match=fragment):
        load_config(config, dp_world_size=None)


def test_config_features_describe_the_run():
    cfg = load_config({"tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 3},
                       "bf16": {"enabled": True}}, dp_world_size=None)
    assert config_features(cfg) == {"tp": "tensor parallelism (tensor_parallel.autotp_size 2)",
                                    "zero": "ZeRO stage 3", "half": "bf16"}
