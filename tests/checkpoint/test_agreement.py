"""Ranks agree on the checkpoint they save or load (issue 9: agreement at each save/load):
different directories are refused on every rank, naming each rank's path."""

import os

import torch

from meshspeed.checkpoint.errors import CheckpointError
from meshspeed.testing import run_distributed
from meshspeed.testing.engines import small_engine, train_step


def _save_and_load_apart(root):
    from meshspeed import comm

    engine = small_engine()
    train_step(engine, torch.randint(0, 16, (1, 4)))
    mine = os.path.join(root, f"rank{comm.get_rank()}")
    out = {}
    try:
        engine.save_checkpoint(mine)
    except CheckpointError as err:
        out["save"] = str(err)
    shared = os.path.join(root, "shared")
    engine.save_checkpoint(shared, tag="a")
    engine.save_checkpoint(shared, tag="b")
    try:
        engine.load_checkpoint(shared, tag="a" if comm.get_rank() == 0 else "b")
    except CheckpointError as err:
        out["load"] = str(err)
    return out


def test_ranks_saving_or_loading_apart_are_refused(tmp_path):
    for out in run_distributed(_save_and_load_apart, world_size=2, args=(str(tmp_path),)):
        assert out["save"].startswith("ranks disagree on the checkpoint save directory")
        assert f"rank 1: {tmp_path}/rank1" in out["save"]
        assert out["load"].startswith("ranks disagree on the checkpoint to load")
        assert f"{tmp_path}/shared/a" in out["load"] and f"{tmp_path}/shared/b" in out["load"]
    assert not (tmp_path / "rank0").exists() or not any((tmp_path / "rank0").iterdir())
