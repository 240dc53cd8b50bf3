"""Checkpoints under context parallelism: saved at cp=2 x dp=2 (world 4, ZeRO 3, sharded
over the dp x cp axis), loaded at cp=2 x dp=1 (ZeRO 1) and in one process (ZeRO 0). The
whole parameters are the saved ones, bit for bit, and the next step from both layouts
gives the same loss (both see the same batch: data depends on dp only)."""

from __future__ import annotations

import pytest
import torch

from meshspeed.testing import run_distributed
from meshspeed.testing.parity import ParitySetup, build_model, full_state_dict, train_steps

BASE = {"steps": 3, "seq": 16, "model": {"n_head": 4, "d_model": 32}}


def _save(path: str):
    import meshspeed

    setup = ParitySetup(world=4, cp=2, stage=3, **BASE)
    engine, *_ = meshspeed.initialize(model=build_model(setup), config=setup.ds_config())
    train_steps(engine, setup, last=2)
    engine.save_checkpoint(path, tag="t")
    return full_state_dict(engine)


def _load(path: str, cp: int, stage: int):
    import meshspeed
    from meshspeed import comm

    setup = ParitySetup(world=comm.get_world_size(), cp=cp, stage=stage, **BASE)
    engine, *_ = meshspeed.initialize(model=build_model(setup, seed=7), config=setup.ds_config())
    engine.load_checkpoint(path, tag="t")
    return full_state_dict(engine), train_steps(engine, setup, first=2, last=3)


@pytest.mark.timeout(600)
def test_cp_checkpoint_loads_at_other_cp_dp_and_stage(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_distributed(_save, 4, args=(path,), timeout=300)[0]
    loaded = [run_distributed(_load, 2, args=(path, 2, 1), timeout=300)[0],
              run_distributed(_load, 1, args=(path, 1, 0), timeout=300)[0]]
    for state, _ in loaded:
        assert state.keys() == saved.keys()
        for name in saved:
            torch.testing.assert_close(state[name], saved[name], rtol=0, atol=0, msg=name)
    (_, loss_cp), (_, loss_one) = loaded
    torch.testing.assert_close(torch.tensor(loss_cp), torch.tensor(loss_one), rtol=1e-5, atol=1e-6)
