"""Checkpoints of the real tensor-parallel GPT: saved at tp=2 x dp=2 (world 4, ZeRO 2,
sequence parallel), loaded at tp=1 x dp=1 (one process, ZeRO 0), tp=1 x dp=2 (ZeRO 3) and
tp=2 x dp=1 (ZeRO 0), and consolidated by `meshspeed convert`; and saved at tp=1 (ZeRO 3)
and loaded at tp=2 (ZeRO 1). The whole parameters are the saved ones, bit for bit, and
one more step from every layout gives the same loss."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from meshspeed.testing import run_distributed
from meshspeed.testing.parity import ParitySetup, build_model, full_state_dict, train_steps

SAVED = ParitySetup(world=4, tp=2, stage=2, sequence_parallel=True, steps=3, tie=True)


def _save(path: str, setup: ParitySetup = SAVED):
    import meshspeed

    engine, *_ = meshspeed.initialize(model=build_model(setup), config=setup.ds_config())
    train_steps(engine, setup, last=2)
    engine.save_checkpoint(path, tag="t")
    return full_state_dict(engine)


def _load(path: str, layouts):
    import meshspeed
    from meshspeed import comm

    out = []
    for tp, stage in layouts:
        setup = ParitySetup(world=comm.get_world_size(), tp=tp, stage=stage, steps=3, tie=True)
        engine, *_ = meshspeed.initialize(model=build_model(setup, seed=7), config=setup.ds_config())
        engine.load_checkpoint(path, tag="t")
        state = full_state_dict(engine)
        out.append((state, train_steps(engine, setup, first=2, last=3)))
    return out


@pytest.mark.timeout(600)
def test_tp_checkpoint_loads_at_other_tp_dp_and_stage_and_converts(tmp_path):
    saved = run_distributed(_save, 4, args=(str(tmp_path / "ckpt"),), timeout=300)[0]
    loaded = run_distributed(_load, 2, args=(str(tmp_path / "ckpt"), [(1, 3), (2, 0)]), timeout=300)[0]
    loaded += run_distributed(_load, 1, args=(str(tmp_path / "ckpt"), [(1, 0)]), timeout=300)[0]
    for state, _ in loaded:
        assert state.keys() == saved.keys()
        for name in saved:
            torch.testing.assert_close(state[name], saved[name], rtol=0, atol=0, msg=name)
    # tp=2 x dp=1 and tp=1 x dp=1 see the same batch (the data depends on dp only): the
    # next step from the loaded state gives the same loss
    _, (_, loss_a), (_, loss_b) = loaded
    torch.testing.assert_close(torch.tensor(loss_a), torch.tensor(loss_b), rtol=1e-5, atol=1e-6)
    out = tmp_path / "whole.safetensors"
    subprocess.run([sys.executable, "-m", "meshspeed.cli", "convert", str(tmp_path / "ckpt"), str(out),
                    "--tag", "t"], check=True, capture_output=True, text=True)
    from safetensors.torch import load_file

    whole = load_file(str(out))
    for name, tensor in whole.items():
        torch.testing.assert_close(tensor.float(), saved[name], rtol=0, atol=0, msg=name)
    assert {k for k in saved if k != "lm_head.weight"} <= set(whole) | {"lm_head.weight"}


@pytest.mark.timeout(600)
def test_tp1_checkpoint_loads_into_tp2(tmp_path):
    plain = ParitySetup(world=2, tp=1, stage=3, steps=3, tie=True)
    saved = run_distributed(_save, 2, args=(str(tmp_path / "ckpt"), plain), timeout=300)[0]
    (state, _), = run_distributed(_load, 2, args=(str(tmp_path / "ckpt"), [(2, 1)]), timeout=300)[0]
    for name in saved:
        torch.testing.assert_close(state[name], saved[name], rtol=0, atol=0, msg=name)
