"""Offload settings that cannot run are ConfigErrors at initialize, on every rank."""

import os

import pytest

from meshspeed.testing import run_distributed
from tests.offload.workers import initialize_error, initialize_error_one_rank_bad, offload, setup


def _error(stage, zero, world=1, **kw):
    config = setup(stage, zero, world=world, **kw).ds_config()
    return run_distributed(initialize_error, world_size=world, args=(config,))


def test_stage_constraints():
    (msg,) = _error(0, offload("cpu"))
    assert "offload_optimizer: needs ZeRO stage 1, 2 or 3" in msg
    (msg,) = _error(2, {"offload_param": {"device": "cpu"}})
    assert msg == ""  # no effect below stage 3, as in DeepSpeed: a warning (tests/compat)
    (msg,) = _error(3, {"offload_param": {"device": "cpu"}, **offload("cpu")})
    assert msg == ""


def test_nvme_path_missing_not_a_directory_or_unwritable(tmp_path):
    (msg,) = _error(2, offload("nvme", str(tmp_path / "nope")))
    assert "offload_optimizer.nvme_path" in msg and "does not exist" in msg
    file = tmp_path / "file"
    file.write_text("")
    (msg,) = _error(2, offload("nvme", str(file)))
    assert "not a directory" in msg
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        (msg,) = _error(2, offload("nvme", str(locked)))
        assert "not writable" in msg


def test_one_bad_rank_stops_every_rank(tmp_path):
    msgs = run_distributed(initialize_error_one_rank_bad, world_size=2, args=(str(tmp_path),))
    assert "does not exist" in msgs[1]
    assert "refused on another rank" in msgs[0]


@pytest.mark.parametrize("zero, needle", [
    (offload("cpu", ratio=0.5), "ratio: only 1.0"),
    ({"offload_optimizer": {"device": "none", "delayed_update": True}}, "delayed_update: needs"),
    ({"offload_param": {"device": "nvme", "nvme_path": "/tmp"}}, "needs offload_optimizer"),
])
def test_unsupported_settings(zero, needle):
    (msg,) = _error(3, zero)
    assert needle in msg


def test_nvme_optimizer_limits(tmp_path):
    (msg,) = _error(2, offload("nvme", str(tmp_path), buffer_count=1))
    assert "buffer_count: 1 is fewer than the 2 swap buffers" in msg
    (msg,) = _error(2, offload("nvme", str(tmp_path)), optimizer="SGD")
    assert "supports Adam and AdamW" in msg
