"""Plans of a launch on several hosts: argv per launcher, exports, filters, ports, errors.
Pure: no process starts (tests/launcher/test_remote_run.py and test_netns_launch.py run them)."""

from __future__ import annotations

import shlex
import sys

import pytest

from meshspeed.launcher import launch, remote_plan
from meshspeed.launcher.ds_launcher import LaunchError
from tests.launcher.test_launch import parse

HOSTFILE = "node0 slots=2\nnode1 slots=2\n"


@pytest.fixture
def hostfile(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "hostfile"
    path.write_text(HOSTFILE)
    return str(path)


def plan(argv, environ=None):
    return launch.launch_plan(parse(argv), device_count=0, environ={"HOME": "/nonexistent", **(environ or {})})


def job(argv, environ=None):
    result = plan(argv, environ)
    assert result.argv == [] and result.remote is not None
    return result.remote


def test_ssh_is_the_default_and_each_host_runs_its_share(hostfile, tmp_path):
    j = job(["--hostfile", hostfile, "--master_port", "29600", "train.py", "--lr", "1"],
            {"PYTHONPATH": "/src", "NCCL_DEBUG": "WARN", "PATH": "/bin"})
    assert (j.launcher, j.hosts, j.master_addr, j.master_port) == ("ssh", {"node0": 2, "node1": 2}, "node0", 29600)
    assert j.exports == {"NCCL_DEBUG": "WARN", "PYTHONPATH": "/src"}  # PATH stays the host's own
    assert j.job_id.startswith("meshspeed-") and j.cwd == str(tmp_path)
    assert remote_plan.node_argv(j, "node1") == [
        sys.executable, "-u", "-m", "meshspeed.cli", "run", "--nproc-per-node", "2", "--nnodes", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:29600", "--rdzv-id", j.job_id,
        "--tee", "3", "train.py", "--lr", "1"]
    ssh = remote_plan.ssh_argv(j, "node1")
    assert ssh[:5] == ["ssh", "-T", "-o", "BatchMode=yes", "node1"]
    words = shlex.split(ssh[-1])
    assert words[:4] == ["cd", str(tmp_path), "&&", "exec"]
    env_part = words[5:words.index(sys.executable)]
    assert env_part == ["NCCL_DEBUG=WARN", "PYTHONPATH=/src",
                        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE=[node1 r${rank}] "]
    guard = words[words.index(sys.executable):words.index("--")]
    assert guard == [sys.executable, "-u", "-m", "meshspeed.launcher.guard", "--host", "node1"]
    assert words[words.index("--") + 1:] == remote_plan.node_argv(j, "node1")


def test_ssh_port_filters_and_user_options(hostfile):
    j = job(["--hostfile", hostfile, "--ssh_port", "2222", "--include", "node0:1@node1", "--max-restarts", "2",
             "--deepspeed-compat", "train.py"])
    assert j.hosts == {"node0": 1, "node1": 2}  # ssh starts uneven hosts (torchrun's c10d allows it)
    assert j.host_env == {"node0": {"CUDA_VISIBLE_DEVICES": "1"}, "node1": {"CUDA_VISIBLE_DEVICES": "0,1"}}
    assert remote_plan.ssh_argv(j, "node0")[2:6] == ["-o", "BatchMode=yes", "-p", "2222"]
    argv = remote_plan.node_argv(j, "node0")
    assert argv[argv.index("--tee") + 2:] == ["--deepspeed-compat", "--max-restarts", "2", "train.py"]
    assert remote_plan.node_env(j, "node0")["CUDA_VISIBLE_DEVICES"] == "1"
    j = job(["--hostfile", hostfile, "--exclude", "node0", "--force_multi", "--rdzv-id", "run7", "t.py"])
    assert j.hosts == {"node1": 2} and j.job_id == "run7"  # one host, started through ssh anyway
    j = job(["--hostfile", hostfile, "--num_nodes", "1", "--num_gpus", "1", "--force_multi", "t.py"])
    assert j.hosts == {"node0": 1}
    # one host without --force_multi runs here, as before
    assert plan(["--hostfile", hostfile, "--num_nodes", "1", "t.py"]).argv == ["--nproc-per-node", "2", "t.py"]


def test_no_ssh_keeps_this_node_only(hostfile):
    result = plan(["--hostfile", hostfile, "--no_ssh", "--node_rank", "1", "t.py"])
    assert result.remote is None and result.argv[:4] == ["--nproc-per-node", "2", "--nnodes", "2"]


def test_deepspeed_env_is_sent(hostfile, tmp_path):
    (tmp_path / ".deepspeed_env").write_text("NCCL_SOCKET_IFNAME=eth0\nMY_FLAG=1\n")
    j = job(["--hostfile", hostfile, "t.py"], {"NCCL_SOCKET_IFNAME": "ib0"})
    assert j.exports == {"MY_FLAG": "1", "NCCL_SOCKET_IFNAME": "eth0"}  # the file wins
    (tmp_path / ".deepspeed_env").write_text("oops\n")
    with pytest.raises(LaunchError, match=r"\.deepspeed_env:1: expected NAME=value"):
        job(["--hostfile", hostfile, "t.py"])


def test_pdsh(hostfile):
    j = job(["--hostfile", hostfile, "--launcher", "pdsh", "--ssh_port", "2200", "t.py"])
    argv, env = remote_plan.pdsh_argv(j)
    assert argv[:6] == ["pdsh", "-S", "-f", "1024", "-w", "node0,node1"]
    assert env == {"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": "-p 2200"}
    words = shlex.split(argv[-1])
    assert "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE=[%h r${rank}] " in words
    assert words[words.index("--host") + 1:words.index("--host") + 3] == ["%h", "--"]
    assert "--node-rank" not in words


def test_openmpi_and_slurm_commands(hostfile, tmp_path):
    j = job(["--hostfile", hostfile, "--launcher", "openmpi", "--master_port", "1234", "t.py", "x"],
            {"PYTHONPATH": "/src"})
    assert remote_plan.mpirun_argv(j) == [
        "mpirun", "-np", "4", "--host", "node0:2,node1:2", "-x", "PYTHONPATH=/src", "-x", "MASTER_ADDR=node0",
        "-x", "MASTER_PORT=1234", "--wdir", str(tmp_path), sys.executable, "-u", "t.py", "x"]
    j = job(["--hostfile", hostfile, "--launcher", "slurm", "--deepspeed-compat", "-m", "pkg.train"],
            {"NCCL_DEBUG": "INFO"})
    assert remote_plan.srun_argv(j) == [
        "srun", "-N", "2", "--ntasks-per-node", "2", "--nodelist", "node0,node1", "--chdir", str(tmp_path),
        "--export", "ALL,NCCL_DEBUG=INFO,MASTER_ADDR=node0,MASTER_PORT=29500",
        sys.executable, "-u", "-m", "meshspeed.compat.child", "--module", "--no-local-rank", "pkg.train"]


SLURM = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "gpu[1-2]", "SLURM_NTASKS_PER_NODE": "2"}


def test_inside_a_slurm_allocation_srun_starts_every_node(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    j = job(["t.py"], SLURM)
    assert (j.launcher, j.hosts, j.master_addr) == ("slurm", {"gpu1": 2, "gpu2": 2}, "gpu1")
    assert remote_plan.srun_argv(j)[:6] == ["srun", "-N", "2", "--ntasks-per-node", "2", "--nodelist"]
    assert job(["--launcher", "ssh", "t.py"], SLURM).launcher == "ssh"
    # inside a job step (srun meshspeed run ...), or with --no_ssh: this node only
    assert plan(["t.py"], {**SLURM, "SLURM_STEP_ID": "0"}).remote is None
    one = plan(["t.py"], {**SLURM, "SLURM_JOB_NODELIST": "gpu1"})
    assert one.remote is None and one.argv == ["--nproc-per-node", "2", "t.py"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--launcher", "openmpi", "--max-restarts", "1", "t.py"], "--max-restarts: a torchrun option"),
    (["--launcher", "slurm", "--include", "node0:0@node1:0", "t.py"], "own CUDA_VISIBLE_DEVICES"),
    (["--launcher", "pdsh", "--include", "node0:0@node1", "t.py"], "different slot counts"),
    (["--rdzv-backend", "etcd", "t.py"], "--rdzv-backend: meshspeed run sets the rendezvous"),
    (["--nnodes", "1:3", "t.py"], "there are 2 hosts"),
    (["--launcher", "openmpi", "--nnodes", "1:2", "t.py"], "elastic jobs need torchrun"),
])
def test_plans_that_cannot_work_are_refused(hostfile, argv, message):
    with pytest.raises(LaunchError, match=message):
        plan(["--hostfile", hostfile, *argv])


def test_elastic_with_a_hostfile(hostfile):
    j = job(["--hostfile", hostfile, "--nnodes", "1:2", "t.py"])
    assert j.nnodes == "1:2" and j.torchrun_options == []
    assert remote_plan.node_argv(j, "node0")[7:9] == ["--nnodes", "1:2"]
    assert job(["--hostfile", hostfile, "--min_elastic_nodes", "1", "t.py"]).nnodes == "1:2"
    assert job(["--hostfile", hostfile, "--elastic_training", "t.py"]).nnodes == "1:2"
