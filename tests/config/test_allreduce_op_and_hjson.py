"""gradient_allreduce_op (typed: "mean" runs, DeepSpeed's "sum" parses and is refused at
build) and config files in HJSON or given as any os.PathLike (issue 35)."""

import json

import pytest

from meshspeed.config import ConfigError, load_config
from meshspeed.config.no_effect import report_no_effect


def test_allreduce_op_defaults_to_mean_and_takes_any_case():
    assert load_config({}).gradient_allreduce_op == "mean"
    assert load_config({"gradient_allreduce_op": "SUM"}).gradient_allreduce_op == "sum"
    assert load_config({"gradient_allreduce_op": "Mean"}).gradient_allreduce_op == "mean"


@pytest.mark.parametrize("value", ["max", 3, None])
def test_allreduce_op_names_the_choices(value):
    with pytest.raises(ConfigError, match='Invalid gradient_allreduce_op .*"mean".*"sum"'):
        load_config({"gradient_allreduce_op": value})


@pytest.mark.parametrize("extra,what", [
    ({"zero_optimization": {"stage": 3}}, "ZeRO stage 3"),
    ({"zero_optimization": {"stage": 2, "zenflow": {}}}, "ZenFlow"),
    ({"compile": {"deepcompile": True}}, "DeepCompile"),
])
def test_sum_is_refused_next_to_what_deepspeed_refuses_it_with(extra, what):
    with pytest.raises(ConfigError, match=f'"sum" is not supported with {what}'):
        load_config({"gradient_allreduce_op": "sum", **extra})
    load_config({"gradient_allreduce_op": "mean", **extra})  # mean is fine with each


def test_sum_is_refused_when_an_engine_would_be_built():
    with pytest.raises(ConfigError, match="gradient_allreduce_op: 'sum' is not supported .*multiply the loss"):
        report_no_effect(load_config({"gradient_allreduce_op": "sum"}))
    assert report_no_effect(load_config({"gradient_allreduce_op": "mean"})) == []


def test_hjson_config_file_is_read(tmp_path):
    hjson = pytest.importorskip("hjson")
    path = tmp_path / "ds.hjson"
    path.write_text(hjson.dumps({"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.5}}}))
    assert not path.read_text().lstrip().startswith('{\n  "')  # really HJSON, not JSON
    cfg = load_config(path, dp_world_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (4, 2)
    assert cfg.optimizer.params == {"lr": 0.5}


def test_hjson_duplicate_key_and_bad_text_are_errors(tmp_path):
    pytest.importorskip("hjson")
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 24, "train_batch_size": 24,}')  # trailing comma: HJSON only
    with pytest.raises(ConfigError, match="'train_batch_size' appears twice"):
        load_config(path)
    path.write_text('{"train_batch_size": 24 "x" }}')
    with pytest.raises(ConfigError, match="not valid JSON: Expecting ',' delimiter"):
        load_config(path)


def test_any_pathlike_is_a_path(tmp_path):
    class Local:  # py.path.local and friends: os.PathLike, not str or Path
        def __init__(self, p):
            self.p = p

        def __fspath__(self):
            return str(self.p)

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 6}))
    assert load_config(Local(path), dp_world_size=3).train_micro_batch_size_per_gpu == 2
