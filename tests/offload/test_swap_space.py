"""Room on the swap disk (Note [room for the files the first step writes] in
meshspeed/offload/space.py): initialize counts the moment and gradient files the first
step writes, for every rank that swaps to the same file system, and fails with a
ConfigError naming the path when they do not fit, instead of ENOSPC mid-step.

The count is checked against the files themselves: after a step, the moment and gradient
files hold exactly what initialize said they would. The free space is what
`shutil.disk_usage` reports, so the tests below make it report a disk of a given size."""

from __future__ import annotations

import os
import shutil

import pytest

from meshspeed.config.errors import ConfigError
from meshspeed.testing import run_distributed
from meshspeed.testing.parity import ParitySetup
from tests.offload import infinity_workers
from tests.offload.workers import exact_adamw

MODEL = {"vocab_size": 256, "d_model": 64, "n_layer": 2, "n_head": 2}


def _setup(nvme: str, fast_init: bool = False) -> ParitySetup:
    zero = {
        "stage": 3, "sub_group_size": 1 << 14, "stage3_param_persistence_threshold": 0,
        "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": 8, "fast_init": fast_init},
        "offload_param": {"device": "nvme", "nvme_path": nvme, "buffer_count": 4, "buffer_size": 1 << 14},
    }
    return ParitySetup(stage=3, precision="bf16", model=MODEL, steps=1,
                       extra_config={**exact_adamw(), "zero_optimization": zero})


def counted_and_written(s: ParitySetup) -> tuple[int, int]:
    """What initialize counts for the first step's files, and what they hold after it."""
    from meshspeed.offload import close
    from meshspeed.offload.space import bytes_to_write, planned_files
    from meshspeed.testing.parity import train_steps

    engine = infinity_workers.build_engine(s)
    store = engine.optimizer.store
    files = planned_files(store)
    counted = sum(n for _, n in files)
    moments = [f for f in files if f[0].endswith(".swp")]
    assert moments and len(moments) < len(files)  # and the gradient files
    # preallocated moment files hold their bytes already; the gradient files are still to come
    assert bytes_to_write(files) == counted - (sum(n for _, n in moments) if store.preallocated else 0)
    train_steps(engine, s)
    engine.optimizer.settle()
    written = sum(os.path.getsize(p) for p, _ in files)
    close(engine)
    return counted, written


@pytest.mark.parametrize("fast_init", [False, True], ids=["preallocated", "fast_init"])
def test_the_count_is_what_the_first_step_writes(tmp_path, fast_init):
    counted, written = run_distributed(counted_and_written, world_size=1,
                                       args=(_setup(str(tmp_path), fast_init),), timeout=180)[0]
    assert counted > 0 and counted == written


def build_on_a_disk_of(s: ParitySetup, free: int) -> str:
    """Build the engine with the swap disk reporting `free` bytes; the error, or "built"."""
    from meshspeed.offload import close, space

    real = shutil.disk_usage

    def small(path):
        usage = real(path)
        return usage._replace(free=free)

    space.shutil.disk_usage = small
    try:
        engine = infinity_workers.build_engine(s)
    except ConfigError as err:
        return str(err)
    finally:
        space.shutil.disk_usage = real
    close(engine)
    return "built"


def _need(tmp_path, world: int) -> int:
    """One rank's moment + gradient bytes at this world size."""
    return sum(run_distributed(_one_rank_need, world_size=world, args=(_setup(str(tmp_path)),), timeout=180)) // world


def _one_rank_need(s: ParitySetup) -> int:
    return counted_and_written(s)[0]


def test_a_disk_too_small_fails_at_initialize_naming_the_path(tmp_path):
    need = _need(tmp_path, 1)
    err = run_distributed(build_on_a_disk_of, world_size=1, args=(_setup(str(tmp_path)), need - 4096),
                          timeout=180)[0]
    assert "offload_optimizer.nvme_path" in err and "this rank needs" in err, err
    assert os.listdir(tmp_path) == [], "nothing is left behind"
    ok = run_distributed(build_on_a_disk_of, world_size=1, args=(_setup(str(tmp_path)), need), timeout=180)[0]
    assert ok == "built"


def test_ranks_sharing_a_disk_are_counted_together(tmp_path):
    """Two ranks, one path: room for one and a half ranks' files is not enough, for two it is."""
    need = _need(tmp_path, 2)
    errs = run_distributed(build_on_a_disk_of, world_size=2, args=(_setup(str(tmp_path)), need + need // 2),
                           timeout=180)
    for err in errs:
        assert "the 2 ranks on this host that swap to it need" in err, err
    ok = run_distributed(build_on_a_disk_of, world_size=2, args=(_setup(str(tmp_path)), 2 * need),
                         timeout=180)
    assert ok == ["built", "built"]
