"""One disk per rank (issue 33): `nvme_path` may be a list, local rank r swaps under
`path[r % len]` (Note [one disk per rank] in meshspeed/offload/swapdir.py).

Two directories stand in for two disks. At world 2 every file of rank r is under its own
directory, and each rank's share of a step's swap bytes is half of what one rank moves
alone (ZeRO-3 gives each rank half the state), so each disk carries half the bytes.
"""

from __future__ import annotations

import os

import pytest

from meshspeed.config.errors import ConfigError
from meshspeed.offload.swapdir import check_nvme_path, rank_path
from meshspeed.testing import run_distributed
from meshspeed.testing.parity import ParitySetup
from tests.offload import infinity_workers
from tests.offload.workers import exact_adamw, train_counting_last_step

# big enough that a rank's half of each swap file is far above the 4 KiB direct-I/O alignment
MODEL = {"vocab_size": 256, "d_model": 64, "n_layer": 2, "n_head": 2}


def test_rank_path_picks_round_robin_by_local_rank():
    paths = ["/disk0", "/disk1"]
    assert [rank_path(paths, r) for r in range(4)] == ["/disk0", "/disk1", "/disk0", "/disk1"]
    assert rank_path("/one", 3) == "/one"  # a single path: every rank under it
    with pytest.raises(ConfigError, match="empty list"):
        rank_path([], 0)


def test_each_directory_of_a_list_is_checked(tmp_path):
    good = tmp_path / "disk0"
    good.mkdir()
    check_nvme_path([str(good)], "offload_param.nvme_path")
    with pytest.raises(ConfigError, match=r"nvme_path\[1\]: .*disk1.* does not exist"):
        check_nvme_path([str(good), str(tmp_path / "disk1")], "offload_param.nvme_path")


def _setup(nvme) -> ParitySetup:
    zero = {
        "stage": 3, "sub_group_size": 1 << 14, "stage3_max_live_parameters": 1 << 20,
        "stage3_prefetch_bucket_size": 1 << 20, "stage3_param_persistence_threshold": 0,
        "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": 8},
        "offload_param": {"device": "nvme", "nvme_path": nvme, "buffer_count": 4, "buffer_size": 1 << 14},
    }
    return ParitySetup(stage=3, precision="bf16", model=MODEL, steps=2,
                       extra_config={**exact_adamw(), "zero_optimization": zero})


def step_bytes(s: ParitySetup) -> dict:
    """Train the setup; the swap bytes of the last step and the files of this rank."""
    from meshspeed.offload import close

    engine = infinity_workers.build_engine(s)
    _, moved = train_counting_last_step(engine, s)
    dirs = sorted(d.path for d in engine.strategy.placement.swap_dirs.values())
    files = {d: sum(infinity_workers.tree(d).values()) for d in dirs}
    close(engine)
    return {**moved, "files": files}


def test_two_ranks_two_disks_halve_each_disks_bytes(tmp_path):
    disks = [tmp_path / "disk0", tmp_path / "disk1"]
    for d in disks:
        d.mkdir()
    alone = run_distributed(step_bytes, world_size=1, args=(_setup(str(disks[0])),), timeout=180)[0]
    got = run_distributed(step_bytes, world_size=2, args=(_setup([str(d) for d in disks]),), timeout=180)
    for rank, r in enumerate(got):
        # every swap file of rank r lies under disks[r], one directory of its own there
        (own,) = r["files"]
        assert os.path.dirname(own) == str(disks[rank]), (rank, own)
        assert os.listdir(disks[rank]) == [], "the swap directory is removed at close"
        for key in ("read", "write"):
            # half of one rank's bytes alone, to within the shards' padding
            assert r[key] > 0 and abs(r[key] - alone[key] / 2) <= 0.02 * alone[key], (key, r[key], alone[key])
        assert abs(r["files"][own] - alone["files"][next(iter(alone["files"]))] / 2) <= \
            0.02 * sum(alone["files"].values()), (r["files"], alone["files"])


def test_zero_init_spills_to_this_ranks_directory(tmp_path):
    from meshspeed.config.offload import OffloadParamConfig
    from meshspeed.parallel.zero.init_spill import nvme_path_from

    disks = [tmp_path / "disk0", tmp_path / "disk1"]
    disks[0].mkdir()  # rank 0 (no launcher: local rank 0) needs only its own
    cfg = OffloadParamConfig.checked({"device": "nvme", "nvme_path": [str(d) for d in disks]},
                                     "zero_optimization.offload_param.")
    assert nvme_path_from(cfg) == str(disks[0])
