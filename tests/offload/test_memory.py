"""`memory_breakdown()["tiers"]`: offloaded state leaves the device tier (dp=2, fp32
unless named). Psi_r = trainable elements this rank owns; Adam keeps 8 Psi_r bytes."""

import pytest

from meshspeed.testing import run_distributed
from tests.offload.workers import breakdown, offload, setup

SCALARS = 64 * 8  # Adam step counters: one 4-byte scalar per parameter, with allocator slack


def _run(*setups):
    return [run_distributed(breakdown, world_size=2, args=(s,))[0] for s in setups]


def test_no_offload_everything_on_device():
    (r,) = _run(setup(2))
    mem = r["mem"]
    assert mem["tiers"] == {"device": mem["total"], "host": 0, "nvme": 0}


@pytest.mark.parametrize("stage", [1, 3])
def test_cpu_offload_moves_optimizer_state_to_host(stage):
    base, off = _run(setup(stage), setup(stage, offload("cpu")))
    mem, psi = off["mem"], off["owned"]
    assert abs(mem["optimizer_state"] - 8 * psi) <= SCALARS
    assert mem["optimizer_state"] == base["mem"]["optimizer_state"]  # same bytes, other tier
    assert mem["tiers"]["host"] >= mem["optimizer_state"]
    assert mem["tiers"]["device"] == base["mem"]["total"] - base["mem"]["optimizer_state"]
    assert mem["tiers"]["device"] + mem["tiers"]["host"] == mem["total"]
    assert mem["tiers"]["nvme"] == 0


def test_bf16_masters_and_grads_leave_the_device():
    """Measured between steps: the device holds the bf16 parameters and the staging
    buffers; the host holds the fp32 masters, Adam's state and the persistent fp32
    gradient buffer the host step reads, which is the only gradient copy kept (the bf16
    shard is freed once copied: Note [one gradient copy between steps])."""
    base, off = _run(setup(2, precision="bf16"), setup(2, offload("cpu"), precision="bf16"))
    mem, psi = off["mem"], off["owned"]
    assert mem["master_params"] == base["mem"]["master_params"] == 4 * psi
    assert mem["grads"] == 4 * psi  # host fp32 copy only
    assert mem["params"] == base["mem"]["params"]
    assert mem["tiers"]["device"] == mem["params"] + mem["comm_buffers"]
    assert mem["tiers"]["host"] == mem["master_params"] + 4 * psi + mem["optimizer_state"]


def test_nvme_bytes_match_the_files(tmp_path):
    (r,) = _run(setup(3, {**offload("nvme", str(tmp_path), buffer_count=4),
                          "sub_group_size": 3000}))
    mem, psi = r["mem"], r["owned"]
    assert mem["tiers"]["nvme"] == r["files"] > 0
    assert 8 * psi <= r["files"] <= 8 * psi + 2 * 4096 * (psi // 3000 + 2)  # O_DIRECT padding
    # optimizer_state counts the state wherever it is: files plus resident swap buffers
    pool = 4 * (4096 * (-(-3000 * 4 // 4096)) + 4096)  # 4 buffers, aligned, + alignment slack
    assert mem["optimizer_state"] - r["files"] <= pool + SCALARS
    assert mem["tiers"]["device"] + mem["tiers"]["host"] + mem["tiers"]["nvme"] == mem["total"]
    assert r["removed"]  # close() removed this rank's swap directory


def test_param_offload_counts_shards_as_host():
    base, off = _run(setup(3), setup(3, {"offload_param": {"device": "cpu"}}))
    assert off["mem"]["params"] == base["mem"]["params"]
    assert off["mem"]["tiers"]["host"] == off["mem"]["params"]
    assert off["mem"]["tiers"]["device"] == base["mem"]["total"] - base["mem"]["params"]
