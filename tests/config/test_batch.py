"""The batch triad: train_batch_size = micro batch * accumulation steps * DP world size."""

import pytest

from meshspeed.config import ConfigError, load_config

TBS, MBS, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
SOURCE = "WORLD_SIZE=4 from torchrun"


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({}, (4, 1, 1)),
        ({TBS: 32}, (32, 8, 1)),
        ({MBS: 2}, (8, 2, 1)),
        ({GAS: 3}, (12, 1, 3)),
        ({TBS: 32, MBS: 2}, (32, 2, 4)),
        ({TBS: 32, GAS: 2}, (32, 4, 2)),
        ({MBS: 2, GAS: 3}, (24, 2, 3)),
        ({TBS: 24, MBS: 2, GAS: 3}, (24, 2, 3)),
        ({TBS: 3.2e1, MBS: 2.0}, (32, 2, 4)),  # JSON floats that are whole numbers
    ],
)
def test_triad_derivation_every_combination(given, expected):
    cfg = load_config(given, dp_world_size=4, dp_source=SOURCE)
    got = (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    )
    assert got == expected
    assert all(type(v) is int for v in got)


def test_inconsistent_triad_lists_all_numbers_and_dp_source():
    with pytest.raises(ConfigError) as info:
        load_config(
            {TBS: 32, MBS: 4, GAS: 2}, dp_world_size=2, dp_source="WORLD_SIZE=2 from torchrun"
        )
    msg = str(info.value)
    assert msg.startswith(
        "train_batch_size 32 != train_micro_batch_size_per_gpu 4 * gradient_accumulation_steps 2 "
        "* data-parallel world size 2 (= 16; world size detected from WORLD_SIZE=2 from torchrun)."
    )
    # each single-number fix that would work is offered
    assert "train_batch_size to 16" in msg
    assert "gradient_accumulation_steps to 4" in msg
    assert "train_micro_batch_size_per_gpu to 8" in msg


@pytest.mark.parametrize(
    ("given", "missing"),
    [
        ({TBS: 30, MBS: 4}, GAS),
        ({TBS: 30, GAS: 4}, MBS),
        ({TBS: 30}, MBS),
    ],
)
def test_non_divisible_names_numbers_and_source(given, missing):
    with pytest.raises(ConfigError) as info:
        load_config(given, dp_world_size=4, dp_source=SOURCE)
    msg = str(info.value)
    assert "train_batch_size 30 is not divisible" in msg
    assert "data-parallel world size 4" in msg and SOURCE in msg
    assert f"{missing} (not set) cannot be derived" in msg
    assert "multiple of" in msg


def test_default_source_is_explained():
    with pytest.raises(ConfigError, match="not detected from a launcher"):
        load_config({TBS: 8, MBS: 2, GAS: 2}, dp_world_size=1)


@pytest.mark.parametrize("bad", [0, -2, 2.5, "8", True])
def test_batch_values_type_and_range(bad):
    with pytest.raises(ConfigError, match=f"^{MBS}: "):
        load_config({MBS: bad})


@pytest.mark.parametrize("dp", [0, -1, 1.5, True])
def test_bad_world_size(dp):
    with pytest.raises(ConfigError, match="data-parallel world size must be a positive integer"):
        load_config({}, dp_world_size=dp, dp_source="test")


def test_reloading_a_config_rederives_only_what_user_left_out():
    cfg = load_config({MBS: 4, GAS: 2})  # dp defaults to 1 -> train_batch_size 8
    assert cfg.train_batch_size == 8
    again = load_config(cfg, dp_world_size=4, dp_source=SOURCE)
    assert (again.train_batch_size, again.train_micro_batch_size_per_gpu) == (32, 4)
    assert load_config(cfg) is cfg  # nothing to change

    fixed = load_config({TBS: 8, MBS: 4, GAS: 2})
    with pytest.raises(ConfigError, match=r"!= .* world size 4"):
        load_config(fixed, dp_world_size=4, dp_source=SOURCE)


def test_accelerate_counting_one_process_gets_the_gloo_hint(monkeypatch):
    """accelerate with no GPU finds no device backend and fills train_batch_size for one
    process (micro x accumulation); the error says what to pass."""
    given = {TBS: 4, MBS: 2, GAS: 2}
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    with pytest.raises(ConfigError) as plain:
        load_config(given, dp_world_size=2, dp_source=SOURCE)
    assert "gloo" not in str(plain.value)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ConfigError) as info:
        load_config(given, dp_world_size=2, dp_source=SOURCE)
    assert 'InitProcessGroupKwargs(backend="gloo")' in str(info.value)
