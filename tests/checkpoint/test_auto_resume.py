"""`checkpoint.auto_resume` (Note [what auto_resume loads]): which checkpoint a restarted
job resumes from, initialize loading it, and `load_checkpoint` on a first run. The restart
under torchrun itself is tests/process/test_auto_resume.py."""

from __future__ import annotations

import json
import os

import pytest
import torch

from meshspeed.checkpoint.resume import newest_complete
from meshspeed.config import ConfigError, load_config
from meshspeed.testing.engines import small_engine, train_step
from meshspeed.testing.harness import run_distributed


def _tag(save_dir, tag: str, steps: int) -> None:
    os.makedirs(save_dir / tag)
    (save_dir / tag / "meta.json").write_text(json.dumps({"counters": {"global_steps": steps}}))


def test_newest_complete_checkpoint(tmp_path):
    assert newest_complete(tmp_path / "nope")[0] is None  # a first run: no directory yet
    os.makedirs(tmp_path / "global_step9.tmp-ab12")  # a save killed halfway
    (tmp_path / "global_step9.tmp-ab12" / "meta.json").write_text("{}")
    assert newest_complete(tmp_path)[0] is None
    _tag(tmp_path, "global_step6", 6)
    _tag(tmp_path, "global_step3", 3)  # written later, fewer steps
    assert newest_complete(tmp_path) == ("global_step6", "no 'latest'; the complete checkpoint with the most steps")
    (tmp_path / "latest").write_text("global_step3")
    assert newest_complete(tmp_path) == ("global_step3", "latest")  # latest wins when complete
    for stale in ("global_step12", "../elsewhere"):  # deleted, or not a tag at all
        (tmp_path / "latest").write_text(stale)
        tag, why = newest_complete(tmp_path)
        assert tag == "global_step6" and why.startswith(f"'latest' names {stale!r}"), why


def test_auto_resume_config():
    assert load_config({"checkpoint": {"auto_resume": True}}).checkpoint.dir is None
    assert load_config({"checkpoint": {"auto_resume": True, "dir": "ck"}}).checkpoint.dir == "ck"
    with pytest.raises(ConfigError, match="dir is read only by auto_resume"):
        load_config({"checkpoint": {"dir": "ck"}})


def _resume_in_initialize(root: str) -> tuple:
    from meshspeed.checkpoint import CheckpointError

    ckpt, empty = os.path.join(root, "ckpt"), os.path.join(root, "empty")
    config = {"checkpoint": {"auto_resume": True, "dir": ckpt}}
    a = small_engine(1, seed=0, **config)  # a first run: nothing to resume, no error
    started_at = a.global_steps
    for _ in range(3):
        train_step(a, torch.randint(0, 16, (1, 4)))
    a.save_checkpoint(ckpt)
    b = small_engine(1, seed=7, **config)  # the restarted job, built from another seed
    same = all(torch.equal(p, q) for p, q in zip(a.module.parameters(), b.module.parameters(), strict=True))
    first_run = b.load_checkpoint(empty)  # a script's own load_checkpoint on a first run
    plain = small_engine(1, seed=0)
    try:
        plain.load_checkpoint(empty)
        refused = None
    except CheckpointError as err:
        refused = str(err)
    return started_at, b.global_steps, same, first_run, refused


def test_initialize_resumes_and_a_first_run_loads_nothing(tmp_path):
    for started_at, resumed_at, same, first_run, refused in run_distributed(
            _resume_in_initialize, 2, args=(str(tmp_path),)):
        assert (started_at, resumed_at, same) == (0, 3, True)
        assert first_run == (None, None)
        assert refused is not None and "does not exist" in refused  # without auto_resume: an error
