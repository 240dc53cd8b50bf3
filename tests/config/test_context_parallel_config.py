"""The `context_parallel` block and DeepSpeed's `sequence_parallel_size`."""

import pytest

from meshspeed.config import ConfigError, load_config


def test_sequence_parallel_size_is_ulysses():
    seq = load_config({"sequence_parallel_size": 4}).sequence
    assert (seq.size, seq.mode, seq.all_to_all_size, seq.ring_size) == (4, "ulysses", 4, 1)


def test_the_block_chooses_the_method():
    seq = load_config({"context_parallel": {"size": 4}}).sequence
    assert (seq.size, seq.mode, seq.all_to_all_size, seq.ring_size) == (4, "ring_balanced", 1, 4)
    seq = load_config({"context_parallel": {"size": 8, "mode": "hybrid", "ulysses_size": 2}}).sequence
    assert (seq.all_to_all_size, seq.ring_size) == (2, 4)


def test_both_keys_agreeing_are_one_degree():
    cfg = load_config({"sequence_parallel_size": 2, "context_parallel": {"size": 2, "mode": "ring"}})
    assert (cfg.sequence.size, cfg.sequence.mode) == (2, "ring")


@pytest.mark.parametrize("config, says", [
    ({"sequence_parallel_size": 2, "context_parallel": {"size": 4}}, "name the same degree"),
    ({"context_parallel": {"size": 4, "mode": "hybrid"}}, "needs ulysses_size"),
    ({"context_parallel": {"size": 4, "mode": "hybrid", "ulysses_size": 3}}, "a divisor of the size"),
    ({"context_parallel": {"size": 4, "mode": "hybrid", "ulysses_size": 4}}, "exclusive"),
    ({"context_parallel": {"size": 4, "mode": "ring", "ulysses_size": 2}}, "is for mode \"hybrid\""),
    ({"context_parallel": {"size": 4, "mode": "ulyses"}}, "must be one of"),
    ({"context_parallel": {"sise": 4}}, "sise"),
    ({"sequence_parallel_size": 0}, "sequence_parallel_size"),
])
def test_bad_values_are_one_sentence(config, says):
    with pytest.raises(ConfigError) as err:
        load_config(config)
    assert says in str(err.value)
