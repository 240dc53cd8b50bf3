"""Launcher detection (pure) and a real 1-process init in a clean subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from meshspeed.process.distributed import LaunchEnv, detect_launch_env, first_slurm_host


def test_torchrun_environment():
    env = detect_launch_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                             "MASTER_ADDR": "node0", "MASTER_PORT": "1234",
                             "TORCHELASTIC_RUN_ID": "x"})
    assert env == LaunchEnv("torchrun", 3, 4, 1, "node0", 1234, "WORLD_SIZE")
    assert env.describe() == "WORLD_SIZE=4 from torchrun"
    plain = detect_launch_env({"RANK": "0", "WORLD_SIZE": "2"})
    assert plain.launcher == "env" and plain.master_port is None
    assert plain.describe() == "WORLD_SIZE=2 from RANK/WORLD_SIZE environment variables"


def test_slurm_environment():
    env = detect_launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                             "SLURM_NODELIST": "gpu[003-004]"})
    assert env == LaunchEnv("slurm", 5, 8, 1, "gpu003", 29500, "SLURM_NTASKS")
    assert env.describe() == "SLURM_NTASKS=8 from Slurm"
    env = detect_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "16",
                             "SLURM_STEP_NUM_TASKS": "4", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.7",
                             "SLURM_NODELIST": "a,b", "MASTER_PORT": "4000"})
    assert (env.world_size, env.master_addr, env.master_port) == (4, "10.0.0.7", 4000)
    # MASTER_ADDR wins over Slurm's variables; RANK/WORLD_SIZE win over Slurm altogether
    assert detect_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2",
                              "MASTER_ADDR": "x"}).master_addr == "x"
    assert detect_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "RANK": "1",
                              "WORLD_SIZE": "2"}).launcher == "env"


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("node7", "node7"),
        ("a,b,c", "a"),
        ("gpu[003-010,015],cpu1", "gpu003"),
        ("gpu[12,3-5]", "gpu12"),
        ("rack[1-2]-node[01-04]", "rack1-node01"),
        ("", None),
    ],
)
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_open_mpi_environment():
    env = detect_launch_env({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
                             "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    # ranks span nodes and nobody said where rank 0 is: init_distributed must ask for it
    assert env == LaunchEnv("openmpi", 2, 4, 0, None, 29500, "OMPI_COMM_WORLD_SIZE")
    assert env.describe() == "OMPI_COMM_WORLD_SIZE=4 from Open MPI"
    single_node = detect_launch_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                                     "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert single_node.master_addr == "127.0.0.1" and single_node.local_rank == 0


def test_pmi_and_no_launcher():
    env = detect_launch_env({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"})
    assert (env.launcher, env.rank, env.world_size, env.local_rank) == ("pmi", 1, 2, 1)
    alone = detect_launch_env({})
    assert alone == LaunchEnv("none", 0, 1, 0, "127.0.0.1", None, "")
    assert alone.describe() == "1 process, no launcher"


def test_bad_values_name_the_variable():
    with pytest.raises(ValueError, match="WORLD_SIZE='four'"):
        detect_launch_env({"RANK": "0", "WORLD_SIZE": "four"})
    with pytest.raises(ValueError, match="SLURM_NTASKS"):
        detect_launch_env({"SLURM_PROCID": "0"})


_INIT_ONE_PROCESS = """
import datetime, os
import torch.distributed as dist
import meshspeed
from meshspeed.process.distributed import describe_world, get_local_rank, init_distributed
assert describe_world() == "1 process, no launcher", describe_world()
meshspeed.init_distributed(timeout=60)
assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_rank() == 0
assert dist.get_backend() == "gloo"
assert describe_world() == "1 process, no launcher" and get_local_rank() == 0
assert os.environ["WORLD_SIZE"] == "1" and os.environ["MASTER_ADDR"] == "127.0.0.1"
init_distributed(dist_backend="gloo", auto_mpi_discovery=False, distributed_port=1)  # no-op
dist.destroy_process_group()
try:  # the caller said it made the group, and there is none (as DeepSpeed: an assertion)
    init_distributed(dist_init_required=False)
except AssertionError:
    assert not dist.is_initialized()
else:
    raise SystemExit("init_distributed(dist_init_required=False) returned without a process group")
print("ok")
"""

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                  "TORCHELASTIC_RUN_ID")


def test_single_process_init_with_clean_environment():
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCHER_VARS and not k.startswith(("SLURM_", "OMPI_", "PMI_"))}
    env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run([sys.executable, "-c", _INIT_ONE_PROCESS], env=env, check=False,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_port_and_explicit_arguments(monkeypatch):
    from meshspeed.process.distributed import _resolve

    monkeypatch.delenv("MASTER_PORT", raising=False)
    alone = _resolve(detect_launch_env({}), -1, -1, distributed_port=29500)
    assert alone.master_port != 29500 and alone.master_port > 0  # free port: runs never collide
    slurm = detect_launch_env({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_NODELIST": "n1"})
    assert _resolve(slurm, -1, -1, distributed_port=1234).master_port == 1234
    assert _resolve(slurm, -1, -1, distributed_port=None).master_port == 29500
    explicit = _resolve(detect_launch_env({"MASTER_ADDR": "h"}), 1, 2, None)
    assert (explicit.rank, explicit.world_size, explicit.master_port) == (1, 2, 29500)
    assert explicit.describe() == "world_size=2 from init_distributed arguments"
    monkeypatch.setenv("MASTER_PORT", "4321")  # an explicit MASTER_PORT beats distributed_port
    slurm = detect_launch_env({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "MASTER_PORT": "4321"})
    assert _resolve(slurm, -1, -1, distributed_port=1234).master_port == 4321
