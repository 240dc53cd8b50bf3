"""save_checkpoint's argument errors, as the exception types DeepSpeed's callers catch:
ranks disagreeing on the tag (tag_validation "FAIL") and a missing save_dir."""

import torch

from meshspeed.testing import run_distributed


def _bad_saves(tmp):
    from meshspeed import comm
    from meshspeed.checkpoint.errors import CheckpointError
    from meshspeed.testing.engines import small_engine

    torch.set_num_threads(1)
    engine = small_engine(1, checkpoint={"tag_validation": "FAIL"})
    out = {}
    try:
        engine.save_checkpoint(tmp, tag=f"tag-{comm.get_rank()}")
    except AssertionError as err:
        out["tag"] = (isinstance(err, CheckpointError), str(err))
    for save_dir in (None, ""):
        try:
            engine.save_checkpoint(save_dir)
        except ValueError as err:
            out[repr(save_dir)] = (isinstance(err, CheckpointError), str(err))
    return out


def test_tag_mismatch_is_an_assertion_and_a_missing_dir_a_value_error(tmp_path):
    for out in run_distributed(_bad_saves, world_size=2, args=(str(tmp_path),), timeout=90):
        ours, msg = out["tag"]
        assert ours and "ranks disagree on the checkpoint tag: ['tag-0', 'tag-1']" in msg
        for key in ("None", "''"):
            ours, msg = out[key]
            assert ours and f"save_dir={key}" in msg
    assert list(tmp_path.iterdir()) == []  # nothing was written
