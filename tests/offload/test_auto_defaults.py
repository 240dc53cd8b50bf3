"""initialize with the ZeRO-Infinity tutorial's config (stage 3, both offloads on nvme,
nothing else): the unset buffer settings are chosen from the model and MemAvailable
(meshspeed/offload/auto.py, Note [defaults that fit]), said in one line on rank 0, and
the engine trains with them; a set value is kept; nothing that fits is a ConfigError."""

from __future__ import annotations

import math

import torch

from meshspeed.config.loader import load_config
from meshspeed.models.gpt import GPT, GPTConfig
from meshspeed.offload.auto import given, unit_sizes
from meshspeed.planner.activations import ModelShape
from meshspeed.planner.nvme_defaults import KEYS, choose
from meshspeed.planner.offload import UnitSizes
from meshspeed.testing import run_distributed
from tests.offload import auto_workers
from tests.offload.auto_workers import TINY, tutorial

GiB = 2**30


def test_the_units_initialize_sees_are_the_estimates_shape():
    """`meshspeed estimate` sizes a decoder from its shape; initialize from the units the
    strategy builds: for the reference GPT they agree (the 2B model's width and vocabulary,
    4 of its 37 blocks, on the meta device)."""
    cfg = GPTConfig(vocab_size=32768, max_seq_len=128, n_layer=4, n_head=32, d_model=2048)
    with torch.device("meta"):
        model = GPT(cfg)
    real = unit_sizes(model, 0)
    shape = UnitSizes.of_shape(ModelShape(n_layer=4, d_model=2048, n_head=16, vocab_size=32768))
    assert real.block == shape.block and real.n_blocks == 4
    assert real.block_param == shape.block_param and real.root_param == shape.root_param
    assert real.root == shape.root + 2048  # the final norm rides in the root unit
    assert choose(real, 1, 22 * GiB, {}).values == choose(shape, 1, 22 * GiB, {}).values


def test_set_means_in_the_config_deepspeed_spellings_too(tmp_path):
    cfg = load_config(tutorial(str(tmp_path)))
    assert given(cfg) == {}
    z = {"max_live_parameters": 5e8, "sub_group_size": 1e9}  # DeepSpeed's alias, its default
    cfg = load_config(tutorial(str(tmp_path), **z) | {"zero_optimization": {
        **tutorial(str(tmp_path), **z)["zero_optimization"],
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 5}}})
    assert given(cfg) == {"stage3_max_live_parameters": 500_000_000, "sub_group_size": 10**9,
                          "offload_param.buffer_count": 5}


def test_tutorial_config_chooses_logs_once_and_trains(tmp_path):
    available = 16 * GiB
    with torch.device("meta"):
        sizes = unit_sizes(GPT(GPTConfig(**TINY)), 0)
    expected = choose(sizes, 2, available // 2, {"sub_group_size": 30_000}).values
    ranks = run_distributed(auto_workers.tutorial_run, world_size=2,
                            args=(str(tmp_path), available), kwargs={"sub_group_size": 30_000})
    first, second = ranks
    # one line for the buffers and one for what stays in memory (residency.py), rank 0 only
    assert second["lines"] == []
    chose = [x for x in first["lines"] if x.startswith("ZeRO-Infinity: chose ")]
    keeping = [x for x in first["lines"] if x.startswith("ZeRO-Infinity: keeping ")]
    assert len(chose) == 1 and len(keeping) == 1 and len(first["lines"]) == 2
    line = chose[0]
    assert line.startswith("ZeRO-Infinity: chose stage3_max_live_parameters ")
    assert "sub_group_size" not in line.split(" from ")[0]  # set: kept, not chosen
    assert "8.0 GiB available per rank" in line  # MemAvailable over the host's 2 ranks
    for r in ranks:
        assert r["settings"] == expected and r["settings"]["sub_group_size"] == 30_000
        assert all(math.isfinite(x) for x in r["losses"]) and r["losses"][-1] < r["losses"][0]
    assert set(expected) == set(KEYS)


def test_nothing_fits_is_a_config_error_on_every_rank(tmp_path):
    # the writes in flight and the interpreter alone are 0.75 GiB
    ranks = run_distributed(auto_workers.tutorial_run, world_size=2,
                            args=(str(tmp_path), GiB))  # 0.5 GiB per rank
    for r in ranks:
        assert "no buffer setting shrinks it further" in r["error"]
        assert "0.5 GiB is available per rank" in r["error"] and r["lines"] == []
