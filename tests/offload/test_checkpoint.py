"""Offloaded optimizer state goes through meshspeed checkpoints: save after 3 steps, train
3 more; a fresh engine that loads the checkpoint trains those 3 steps identically (dp=2)."""

import pytest

from meshspeed.testing import run_distributed
from tests.offload.workers import checkpoint_roundtrip, offload, setup


@pytest.mark.parametrize("stage, device", [(2, "cpu"), (3, "nvme")])
def test_resume_is_exact(stage, device, tmp_path):
    swap = tmp_path / "swap"
    swap.mkdir()
    zero = {**offload(device, str(swap) if device == "nvme" else None), "sub_group_size": 3000}
    s = setup(stage, zero, steps=6)
    tail, again = run_distributed(checkpoint_roundtrip, world_size=2,
                                  args=(s, str(tmp_path / "ckpt")))[0]
    assert tail == again
