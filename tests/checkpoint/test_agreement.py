"""Ranks agree on the checkpoint they save or load (issue 9: agreement at each save/load):
ranks that name different directories use rank 0's (issue 34, tests/checkpoint/
test_rank_dirs.py), but different tags (with tag_validation "Fail") or different checkpoints
to load are refused on every rank, naming each rank's choice."""

import os

import torch

from meshspeed.checkpoint.errors import CheckpointError
from meshspeed.testing import run_distributed
from meshspeed.testing.engines import small_engine, train_step


def _save_and_load_apart(root):
    from meshspeed import comm

    torch.set_num_threads(1)
    engine = small_engine(checkpoint={"tag_validation": "Fail"})
    train_step(engine, torch.randint(0, 16, (1, 4)))
    rank = comm.get_rank()
    out = {}
    try:  # other directories and other tags: the directory is rank 0's, the tags still differ
        engine.save_checkpoint(os.path.join(root, f"rank{rank}"), tag=f"t{rank}")
    except CheckpointError as err:
        out["save"] = str(err)
    shared = os.path.join(root, "shared")
    engine.save_checkpoint(shared, tag="a")
    engine.save_checkpoint(shared, tag="b")
    try:
        engine.load_checkpoint(shared if rank == 0 else os.path.join(root, "other"),
                               tag="a" if rank == 0 else "b")
    except CheckpointError as err:
        out["load"] = str(err)
    return out


def test_ranks_saving_or_loading_different_checkpoints_are_refused(tmp_path):
    for out in run_distributed(_save_and_load_apart, world_size=2, args=(str(tmp_path),), timeout=60):
        assert out["save"].startswith("ranks disagree on the checkpoint tag: ['t0', 't1']")
        assert out["load"].startswith("ranks disagree on the checkpoint to load")
        assert f"{tmp_path}/shared/a" in out["load"] and f"{tmp_path}/shared/b" in out["load"]
    assert not (tmp_path / "rank0").exists() or not any((tmp_path / "rank0").iterdir())
    assert not (tmp_path / "rank1").exists()
