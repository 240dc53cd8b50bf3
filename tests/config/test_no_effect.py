"""Typed fields meshspeed parses without acting on them are reported (once, rank 0) when
set to a non-default value; those that would change the numerics are refused."""

import logging

import pytest

from meshspeed.config import ConfigError, load_config
from meshspeed.config.no_effect import NO_EFFECT, REFUSED, report_no_effect


def _report(extra: dict, rank: int = 0) -> list[str]:
    return report_no_effect(load_config({"train_micro_batch_size_per_gpu": 1, **extra}), rank=rank)


def test_defaults_and_default_values_are_silent(caplog):
    with caplog.at_level(logging.WARNING, logger="meshspeed"):
        assert _report({}) == []
        assert _report({"zero_optimization": {"stage": 2, "reduce_scatter": True,
                                              "contiguous_gradients": True}}) == []
    assert "no effect" not in caplog.text


def test_a_changed_field_is_named_with_its_reason_once(caplog):
    cfg = {"zero_optimization": {"stage": 2, "reduce_scatter": False, "allgather_bucket_size": 5e7},
           "dump_state": True}
    with caplog.at_level(logging.WARNING, logger="meshspeed"):
        notes = _report(cfg)
    assert len(notes) == 3
    assert any(n.startswith("zero_optimization.reduce_scatter=False has no effect: stages 1-3 always "
                            "reduce-scatter") for n in notes)
    assert caplog.text.count("config keys with no effect") == 1
    assert "allgather_bucket_size" in caplog.text and "dump_state" in caplog.text


def test_other_ranks_stay_quiet(caplog):
    with caplog.at_level(logging.WARNING, logger="meshspeed"):
        notes = _report({"zero_optimization": {"reduce_scatter": False}}, rank=1)
    assert notes and "no effect" not in caplog.text


@pytest.mark.parametrize("extra, path", [
    ({"prescale_gradients": True}, "prescale_gradients"),
    ({"gradient_predivide_factor": 2.0}, "gradient_predivide_factor"),
    ({"fp16": {"enabled": True, "auto_cast": True}}, "fp16.auto_cast"),
])
def test_numerics_changing_values_are_refused(extra, path):
    with pytest.raises(ConfigError) as info:
        _report(extra)
    assert str(info.value).startswith(f"{path}: ")
    assert "not supported" in str(info.value)


def test_every_listed_path_exists_in_the_schema():
    from meshspeed.config.no_effect import _value

    cfg = load_config({"train_micro_batch_size_per_gpu": 1,
                       "zero_optimization": {"offload_param": {"device": "cpu"}}})
    missing = [p for p in [*NO_EFFECT, *REFUSED] if _value(cfg, p) is None]
    assert missing == []
