"""ZeRO-Infinity's unset buffer settings, chosen (meshspeed/planner/nvme_defaults.py, Note
[defaults that fit]): pure arithmetic, and the line `meshspeed estimate` prints."""

from __future__ import annotations

import pytest

from meshspeed.cli import main as cli_main
from meshspeed.planner.activations import ModelShape
from meshspeed.planner.nvme_defaults import KEYS, PEAK_CAP, choose, format_choice
from meshspeed.planner.offload import UnitSizes, nvme_host_buffers

GiB = 2**30
# docs/infinity.md's 2B model: the reference GPT, d_model 2048, 37 blocks, vocab 32768
TWO_B = UnitSizes.of_shape(ModelShape(n_layer=37, d_model=2048, n_head=16, vocab_size=32768))
HERE = 22 * GiB  # about what `free -g` says is available on the 24 GiB machine


def test_unset_settings_are_chosen_for_the_overlap_and_fit_8_gib():
    c = choose(TWO_B, 1, HERE, {})
    assert c.fits and set(c.chosen) == set(KEYS)
    assert c.values == {
        "sub_group_size": 20_000_000,  # the largest block parameter (11.2M), 1-2-5 up
        "stage3_max_live_parameters": 240_000_000,  # root 134M + two blocks of 50.4M
        "offload_param.buffer_size": 51_000_000,  # one block's shard
        "offload_optimizer.buffer_count": 8,
        "offload_param.buffer_count": 5,
        "stage3_prefetch_bucket_size": 51_000_000,  # one block
    }
    assert c.budget == PEAK_CAP and c.need <= PEAK_CAP
    # the estimate's own formula, the interpreter on top (one formula, not two)
    by_arg = {"sub_group_size": 20_000_000, "max_live_parameters": 240_000_000,
              "param_buffer_size": 51_000_000, "optimizer_buffer_count": 8,
              "param_buffer_count": 5, "prefetch_bucket_size": 51_000_000}
    assert c.buffers == nvme_host_buffers(TWO_B, **by_arg)
    assert c.need == c.buffers["total"] + GiB // 4


def test_set_settings_are_kept():
    mine = {"sub_group_size": 50_000_000, "offload_optimizer.buffer_count": 6,
            "stage3_max_live_parameters": 300_000_000}
    c = choose(TWO_B, 1, HERE, mine)
    assert c.fits and {k: c.values[k] for k in mine} == mine
    assert set(c.chosen) == set(KEYS) - set(mine)
    # kept even where they cost more than the budget, as long as MemAvailable holds them
    big = choose(TWO_B, 1, HERE, {"sub_group_size": 10**9})
    assert big.fits and big.values["sub_group_size"] == 10**9 and big.need > PEAK_CAP
    assert big.need <= HERE


def test_less_memory_lowers_the_unset_settings_to_half_of_it():
    c = choose(TWO_B, 1, 11 * GiB, {})
    assert c.fits and c.budget == 11 * GiB // 2 and c.need <= c.budget
    roomy = choose(TWO_B, 1, HERE, {})
    lowered = [k for k in KEYS if c.values[k] < roomy.values[k]]
    assert lowered and all(c.values[k] <= roomy.values[k] for k in KEYS)
    # below twice the floors, they go down to what fits MemAvailable itself
    tight = choose(TWO_B, 1, 6 * GiB, {})
    assert tight.fits and tight.budget < tight.need <= 6 * GiB


def test_too_little_memory_names_the_setting_to_lower():
    c = choose(TWO_B, 1, 11 * GiB, {"sub_group_size": 10**9})
    assert not c.fits
    assert "lower zero_optimization.sub_group_size from 1e9 to 5e8" in c.problem
    none_left = choose(TWO_B, 1, 3 * GiB, {})
    assert not none_left.fits and "no buffer setting shrinks it further" in none_left.problem
    assert "3.8 GiB per rank" in none_left.problem and "3.0 GiB is available" in none_left.problem


def test_unknown_memory_aims_at_the_cap_and_never_refuses():
    c = choose(TWO_B, 1, None, {})
    assert c.fits and c.budget == PEAK_CAP and c.available is None
    assert "MemAvailable unknown" in format_choice(c)


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_more_ranks_smaller_shards(dp):
    c = choose(TWO_B, dp, HERE, {})
    shard = -(-TWO_B.block // dp)  # one block's shard, read whole, up to two figures
    assert c.fits and shard <= c.values["offload_param.buffer_size"] <= shard * 1.05


def test_the_line_names_each_choice_and_the_inputs():
    line = format_choice(choose(TWO_B, 1, HERE, {"offload_param.buffer_count": 3}))
    assert line.startswith("ZeRO-Infinity: chose sub_group_size 2e7, stage3_max_live_parameters "
                           "2.4e8, offload_param.buffer_size 5.1e7, offload_optimizer.buffer_count 8, "
                           "stage3_prefetch_bucket_size 5.1e7 from 2.00B parameters and 22.0 GiB "
                           "available per rank")
    assert "offload_param.buffer_count" not in line and line.endswith("(set them to override)")


def test_estimate_prints_the_same_choice(capsys):
    args = ["estimate", "--params", "2e9", "--dp", "1", "--offload-optimizer", "nvme",
            "--offload-param", "nvme", "--device", "cpu", "--host-memory", "22GiB"]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    expected = format_choice(choose(TWO_B, 1, HERE, {}, num_params=1_999_044_608))
    assert expected.split(" from ")[0] in out
    assert "host memory: fits" in out
    # a given setting is kept and left out of the line
    assert cli_main([*args, "--sub-group-size", "5e7"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO-Infinity: chose stage3_max_live_parameters" in out and "sub_group_size 5e7" not in out
    # nothing fits: the line says which setting to lower
    assert cli_main([*args[:-1], "11GiB", "--sub-group-size", "1e9"]) == 0
    assert "lower zero_optimization.sub_group_size from 1e9 to 5e8" in capsys.readouterr().out


def test_deepspeeds_tutorial_dict_is_kept_as_written():
    """DeepSpeed's ZeRO tutorial writes DeepSpeed's defaults out: set, so kept."""
    written = {"sub_group_size": 10**9, "stage3_max_live_parameters": 10**9,
               "stage3_prefetch_bucket_size": 10**7}
    c = choose(TWO_B, 1, HERE, written)
    assert c.fits and {k: c.values[k] for k in written} == written
    assert set(c.chosen) == set(KEYS) - set(written)
    refused = choose(TWO_B, 1, 11 * GiB, written)
    assert "lower zero_optimization.sub_group_size from 1e9" in refused.problem
