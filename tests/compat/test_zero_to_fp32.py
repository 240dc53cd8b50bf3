"""`meshspeed.utils.zero_to_fp32` reads what `engine.save_checkpoint` wrote, at every ZeRO
stage on 2 ranks: the state dict is the engine's fp32 masters, gathered. The runs use
DeepSpeed's `FusedAdam` / `DeepSpeedCPUAdam`, built by the script and adopted by the engine."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from meshspeed.testing.harness import run_distributed
from meshspeed.testing.parity import build_model
from meshspeed.utils.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)
from tests.compat import workers

WORLD = 2


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero_to_fp32")
    return root, run_distributed(workers.save_at_every_stage, WORLD, args=(str(root),))[0]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_state_dict_is_the_gathered_fp32_masters(saved, stage):
    root, runs = saved
    run = runs[stage]
    assert run["param_dtype"] == "torch.bfloat16"  # so masters and parameters differ
    state = get_fp32_state_dict_from_zero_checkpoint(root / f"stage{stage}")
    masters = run["masters"]
    assert set(masters) <= set(state)
    assert state["lm_head.weight"] is state["tok_emb.weight"]  # the tied name is there too
    for name, master in masters.items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], master), name
    # the Adam class from deepspeed.ops.adam trained as the config's AdamW does
    for name, master in run["reference"].items():
        assert torch.equal(masters[name], master), (run["kind"], name)
    assert run["losses"][-1] < run["losses"][0]


def test_frozen_parameters_can_be_left_out(saved):
    root, _ = saved
    full = get_fp32_state_dict_from_zero_checkpoint(root / "stage3", tag=None)
    trainable = get_fp32_state_dict_from_zero_checkpoint(root / "stage3", exclude_frozen_parameters=True)
    left_out = set(full) - set(trainable)
    assert left_out and all(".mlp." in name for name in left_out)


def test_convert_writes_a_loadable_file(saved, tmp_path):
    root, _ = saved
    expected = get_fp32_state_dict_from_zero_checkpoint(root / "stage2", tag="global_step2")
    bin_path = convert_zero_checkpoint_to_fp32_state_dict(root / "stage2", tmp_path / "model.bin")
    st_path = convert_zero_checkpoint_to_fp32_state_dict(root / "stage2", tmp_path / "model.safetensors")
    dir_path = convert_zero_checkpoint_to_fp32_state_dict(root / "stage2", tmp_path / "out",
                                                          safe_serialization=True)
    assert dir_path == str(tmp_path / "out" / "model.safetensors")
    for written in (torch.load(bin_path, weights_only=True), load_file(st_path), load_file(dir_path)):
        assert written.keys() == expected.keys()
        assert all(torch.equal(written[k], expected[k]) for k in expected)


def test_load_state_dict_into_a_fresh_model(saved):
    root, runs = saved
    setup = workers.ParitySetup(steps=2, world=WORLD, micro=2, seq=8, stage=1, precision="bf16",
                                tie=True, frozen=True, model={"n_layer": 1, "d_model": 16})
    model = build_model(setup, seed=7)
    model = load_state_dict_from_zero_checkpoint(model, root / "stage1")
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), runs[1]["masters"][name]), name
