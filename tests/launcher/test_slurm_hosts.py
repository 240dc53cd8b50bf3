"""Slurm node lists and allocations: pure functions."""

from __future__ import annotations

import pytest

from meshspeed.launcher.slurm_hosts import (
    NodeListError,
    allocation_hosts,
    expand_nodelist,
    in_allocation,
)


@pytest.mark.parametrize(("nodelist", "hosts"), [
    ("node1", ["node1"]),
    ("gpu[003-005,010],cpu1", ["gpu003", "gpu004", "gpu005", "gpu010", "cpu1"]),
    ("a[8-11]", ["a8", "a9", "a10", "a11"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("x-[01-02],y", ["x-01", "x-02", "y"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize(("nodelist", "message"), [
    ("a[1-2", "unbalanced"), ("a[5-3]", "backwards"), ("a[x]", "not a number"),
])
def test_bad_nodelists_are_named(nodelist, message):
    with pytest.raises(NodeListError, match=message):
        expand_nodelist(nodelist)


def test_allocation_slots_and_steps():
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NTASKS_PER_NODE": "2",
           "SLURM_GPUS_ON_NODE": "8"}
    assert in_allocation(env)
    assert not in_allocation({**env, "SLURM_STEP_ID": "0"})  # an srun task runs its own share
    assert not in_allocation({"SLURM_JOB_NODELIST": "n1"})
    assert allocation_hosts(env, None, 0) == {"n1": 2, "n2": 2}
    assert allocation_hosts(env, 3, 0) == {"n1": 3, "n2": 3}  # --num_gpus wins
    del env["SLURM_NTASKS_PER_NODE"]
    assert allocation_hosts(env, None, 0) == {"n1": 8, "n2": 8}
    del env["SLURM_GPUS_ON_NODE"]
    assert allocation_hosts(env, None, 4) == {"n1": 4, "n2": 4}
