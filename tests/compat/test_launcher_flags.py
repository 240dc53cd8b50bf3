"""The deepspeed launcher's options, mapped to torchrun's: pure functions, no processes."""

from __future__ import annotations

import pytest

from meshspeed.launcher import launch
from meshspeed.launcher.ds_launcher import (
    DeepSpeedFlags,
    LaunchError,
    parse_filter,
    parse_hostfile,
    plan,
    select,
)
from tests.launcher.test_launch import parse  # meshspeed.cli's parsing of `meshspeed run`

HOSTFILE = """
# the cluster
worker-1 slots=4
worker-2   slots = 4   # trailing comment
"""


def torchrun(argv, device_count=0, environ=None):
    return launch.launch_plan(parse(argv), device_count=device_count, environ=environ or {})


def test_hostfile_format():
    assert parse_hostfile(HOSTFILE) == {"worker-1": 4, "worker-2": 4}
    for bad, message in [("worker-1 4", "expected 'hostname slots=N'"),
                         ("a slots=2\na slots=2", "listed twice"),
                         ("a slots=0", "need at least 1"),
                         ("# nothing\n", "no hosts")]:
        with pytest.raises(LaunchError, match=message):
            parse_hostfile(bad, "hosts")
    with pytest.raises(LaunchError, match="hosts:2: expected"):
        parse_hostfile("a slots=1\nb slots=x", "hosts")


def test_include_exclude_syntax_and_selection():
    assert parse_filter("worker-1:0,2@worker-2", "--include") == {"worker-1": [0, 2], "worker-2": None}
    res = {"worker-1": [0, 1, 2, 3], "worker-2": [0, 1, 2, 3]}
    assert select(res, include="worker-2:1,3") == {"worker-2": [1, 3]}
    assert select(res, include="worker-2@worker-1:0") == {"worker-1": [0], "worker-2": [0, 1, 2, 3]}
    assert select(res, exclude="worker-1:0@worker-2") == {"worker-1": [1, 2, 3]}
    with pytest.raises(LaunchError, match="cannot be combined"):
        select(res, include="worker-1", exclude="worker-2")
    with pytest.raises(LaunchError, match="not among the available hosts"):
        select(res, include="worker-9")
    with pytest.raises(LaunchError, match="no slot"):
        select(res, include="worker-1:7")
    with pytest.raises(LaunchError, match="must be integers"):
        parse_filter("worker-1:a", "--include")


@pytest.mark.parametrize(("argv", "device_count", "expected_argv", "expected_env"), [
    # the tutorials' line; script arguments (even ones named like ours) untouched
    (["--num_gpus", "2", "train.py", "--deepspeed", "--deepspeed_config", "ds.json", "--num_gpus", "9"],
     0, ["--nproc-per-node", "2", "train.py", "--deepspeed", "--deepspeed_config", "ds.json",
         "--num_gpus", "9"], {}),
    (["--include", "localhost:1,3", "train.py"], 4, ["--nproc-per-node", "2", "train.py"],
     {"CUDA_VISIBLE_DEVICES": "1,3"}),
    (["--exclude", "localhost:0", "train.py"], 4, ["--nproc-per-node", "3", "train.py"],
     {"CUDA_VISIBLE_DEVICES": "1,2,3"}),
    # on a CPU machine a slot is a process
    (["--include", "localhost:0,1", "train.py"], 0, ["--nproc-per-node", "2", "train.py"], {}),
    (["--master_port", "1234", "--master_addr", "10.0.0.1", "train.py"], 0,
     ["--nproc-per-node", "1", "--master-addr", "10.0.0.1", "--master-port", "1234", "train.py"], {}),
    # a torchrun option's value before our flag: found anyway, torchrun's order kept
    (["--max-restarts", "3", "--num_gpus", "2", "train.py"], 0,
     ["--nproc-per-node", "2", "--max-restarts", "3", "train.py"], {}),
    (["--num_nodes", "2", "--node_rank", "1", "--master_addr", "node0", "--num_gpus", "4", "train.py"], 8,
     ["--nproc-per-node", "4", "--nnodes", "2", "--node-rank", "1", "--master-addr", "node0",
      "--master-port", "29500", "train.py"], {}),
    (["--bind_cores_to_rank", "--num_gpus", "2", "train.py"], 0,
     ["--nproc-per-node", "2", "train.py"], {"OMP_NUM_THREADS": None}),
    (["--bind_cores_to_rank", "--nproc-per-node", "2", "train.py"], 0,
     ["--nproc-per-node", "2", "train.py"], {"OMP_NUM_THREADS": None}),
    # rendezvous options alone leave the process count to --nproc-per-node
    (["--nproc-per-node", "3", "--master_port", "1234", "train.py"], 0,
     ["--nproc-per-node", "3", "--master-port", "1234", "train.py"], {}),
])
def test_deepspeed_flags_to_torchrun(argv, device_count, expected_argv, expected_env):
    result = torchrun(argv, device_count)
    assert result.argv == expected_argv and not result.compat
    if expected_env.get("OMP_NUM_THREADS", "") is None:  # depends on this machine's cores
        assert int(result.env["OMP_NUM_THREADS"]) >= 1
    else:
        assert result.env == expected_env


def test_include_counts_the_devices_already_visible():
    result = torchrun(["--include", "localhost:0,2", "t.py"], 3, {"CUDA_VISIBLE_DEVICES": "4,5,6"})
    assert result.env == {"CUDA_VISIBLE_DEVICES": "4,6"}


def test_compat_mode_starts_each_rank_in_the_child_entry_point():
    result = torchrun(["--deepspeed-compat", "--num_gpus", "2", "train.py", "--deepspeed"])
    assert result.compat
    assert result.argv == ["--nproc-per-node", "2", "-m", "meshspeed.compat.child", "train.py", "--deepspeed"]
    result = torchrun(["--deepspeed-compat", "--no_local_rank", "-m", "pkg.train", "x"])
    assert result.argv == ["--nproc-per-node", "1", "-m", "meshspeed.compat.child", "--module",
                           "--no-local-rank", "pkg.train", "x"]


def test_hostfile_several_hosts(tmp_path):
    hosts = tmp_path / "hostfile"
    hosts.write_text(HOSTFILE)
    # no --node_rank: a job started on every host (tests/launcher/test_multinode.py)
    result = torchrun(["--hostfile", str(hosts), "--deepspeed-compat", "train.py", "--deepspeed"], 4)
    assert result.argv == [] and result.remote.hosts == {"worker-1": 4, "worker-2": 4}
    assert result.remote.master_addr == "worker-1" and result.remote.run_options == ["--deepspeed-compat"]
    # --node_rank (DeepSpeed's --no_ssh mode): this node's share
    result = torchrun(["--hostfile", str(hosts), "--no_ssh", "--node_rank", "1", "--master_addr", "10.1.1.1",
                       "--include", "worker-1:0,1@worker-2:2,3", "train.py"], 4)
    assert result.argv == ["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr",
                           "10.1.1.1", "--master-port", "29500", "train.py"]
    assert result.env == {"CUDA_VISIBLE_DEVICES": "2,3"}
    # one host of the file: runs here
    result = torchrun(["--hostfile", str(hosts), "--num_nodes", "1", "--num_gpus", "2", "train.py"], 4)
    assert result.argv == ["--nproc-per-node", "2", "train.py"]


@pytest.mark.parametrize(("flags", "message"), [
    (DeepSpeedFlags(num_gpus=2, include="localhost:0"), "cannot be combined"),
    (DeepSpeedFlags(num_gpus=0), "need at least 1"),
    (DeepSpeedFlags(num_gpus=3), "has 2 CUDA device"),
    (DeepSpeedFlags(num_nodes=2), "--node_rank .* --master_addr"),
    (DeepSpeedFlags(hostfile="h", num_nodes=3), "has 2 host"),
    (DeepSpeedFlags(hostfile="h", no_ssh=True), "needs --node_rank"),
    (DeepSpeedFlags(hostfile="h", node_rank=2), "the job has 2 nodes"),
])
def test_impossible_requests_are_refused(flags, message):
    with pytest.raises(LaunchError, match=message):
        plan(flags, device_count=2, hostfile_text=HOSTFILE)


def test_uneven_hosts_and_unsupported_launcher_options():
    with pytest.raises(LaunchError, match="different slot counts"):
        plan(DeepSpeedFlags(hostfile="h", node_rank=0), device_count=0,
             hostfile_text="a slots=2\nb slots=1")
    with pytest.raises(LaunchError, match="--launcher mpich: .* one of ssh, pdsh, openmpi, slurm"):
        torchrun(["--launcher", "mpich", "train.py"])
    with pytest.raises(LaunchError, match="disagree"):
        torchrun(["--nproc-per-node", "3", "--num_gpus", "2", "train.py"])


def test_meshspeed_run_reports_launch_errors(capsys):
    assert launch.main(parse(["--num_gpus", "1", "--include", "localhost:0", "train.py"])) == 2
    assert capsys.readouterr().err.startswith("meshspeed run: --num_gpus/--num_nodes cannot be combined")
