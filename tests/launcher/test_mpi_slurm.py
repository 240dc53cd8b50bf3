"""`--launcher openmpi` / `slurm` and `meshspeed run` inside a Slurm allocation, through fake
`mpirun` / `srun` on PATH (neither is installed): each records its argv and starts the
ranks on this machine with the variables the real one sets, and the script's ranks find
their place through meshspeed.init_distributed. Also plain `srun python train.py`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

# A fake launcher: records argv to $FAKE_RECORD, then starts every rank here with the
# variables its real counterpart gives (only those meshspeed reads), and waits for them.
FAKE = r'''#!{python}
import json, os, subprocess, sys
args = sys.argv[1:]
json.dump(sys.argv, open(os.environ["FAKE_RECORD"], "w"))
env, opts = dict(os.environ), {{}}
while args and args[0].startswith("-"):
    flag = args.pop(0)
    value = args.pop(0)
    if flag in ("-x",):
        key, _, val = value.partition("=")
        env[key] = val
    elif flag == "--export":
        env.update(kv.split("=", 1) for kv in value.split(",")[1:])
    else:
        opts[flag] = value
kind = os.path.basename(sys.argv[0])
if kind == "mpirun":
    world = int(opts["-np"])
    local = [int(h.split(":")[1]) for h in opts["--host"].split(",")][0]
    cwd = opts["--wdir"]
else:
    local = int(opts["--ntasks-per-node"])
    world = int(opts["-N"]) * local
    cwd = opts["--chdir"]
procs = []
for rank in range(world):
    if kind == "mpirun":
        extra = {{"OMPI_COMM_WORLD_RANK": rank, "OMPI_COMM_WORLD_SIZE": world,
                  "OMPI_COMM_WORLD_LOCAL_RANK": rank % local, "OMPI_COMM_WORLD_LOCAL_SIZE": local}}
    else:
        extra = {{"SLURM_PROCID": rank, "SLURM_NTASKS": world, "SLURM_STEP_NUM_TASKS": world,
                  "SLURM_LOCALID": rank % local, "SLURM_STEP_ID": 0, "SLURM_JOB_ID": 1,
                  "SLURM_NTASKS_PER_NODE": local, "SLURM_STEP_NODELIST": opts.get("--nodelist", "")}}
    procs.append(subprocess.Popen(args, cwd=cwd, env={{**env, **{{k: str(v) for k, v in extra.items()}}}}))
sys.exit(max(p.wait() for p in procs))
'''

SCRIPT = """
import json, os, sys
import torch
torch.set_num_threads(1)
import meshspeed
from meshspeed.process.distributed import detect_launch_env
launcher = detect_launch_env(os.environ).launcher  # before init_distributed fills in RANK, WORLD_SIZE
meshspeed.init_distributed(dist_backend="gloo")
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
total = torch.tensor([float(rank)])
torch.distributed.all_reduce(total)
json.dump([rank, world, total.item(), launcher, os.environ.get("MY_FLAG")], open(f"rank{rank}.json", "w"))
"""


@pytest.fixture
def fakes(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("mpirun", "srun"):
        path = bin_dir / name
        path.write_text(FAKE.format(python=sys.executable))
        path.chmod(0o755)
    (tmp_path / "train.py").write_text(SCRIPT)
    # the launched ranks learn who they are from the fakes' OMPI_* / SLURM_* alone: variables
    # an earlier in-process test left behind (init_distributed fills RANK, MASTER_PORT, ...)
    # would take precedence (detect_launch_env) and make every rank rank 0
    leftovers = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "GROUP_RANK", "MESHSPEED_RDZV_ROUND")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "TORCHELASTIC_")) and k not in leftovers}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", FAKE_RECORD=str(tmp_path / "argv.json"),
               OMP_NUM_THREADS="1", MESHSPEED_TEST_MARK="1")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    (tmp_path / ".deepspeed_env").write_text("MY_FLAG=from-env-file\n")
    return env


def _free_port() -> str:
    """A port nobody listens on now (other tests and jobs share this machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _ranks(tmp_path, world):
    return sorted(json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world))


def _meshspeed(tmp_path, env, *argv):
    return subprocess.run([sys.executable, "-m", "meshspeed.cli", "run", *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_openmpi_launcher_runs_one_mpirun(tmp_path, fakes):
    port = _free_port()
    (tmp_path / "hostfile").write_text("localhost slots=2\n")
    done = _meshspeed(tmp_path, fakes, "--hostfile", "hostfile", "--force_multi", "--launcher", "openmpi",
                      "--master_port", port, "train.py")
    assert done.returncode == 0, done.stderr
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[1:6] == ["-np", "2", "--host", "localhost:2", "-x"]
    assert "MY_FLAG=from-env-file" in argv and "MESHSPEED_TEST_MARK=1" in argv and f"MASTER_PORT={port}" in argv
    assert argv[-3:] == [sys.executable, "-u", "train.py"]
    assert done.stderr.startswith("meshspeed run: mpirun -np 2 --host localhost:2")
    assert _ranks(tmp_path, 2) == [[0, 2, 1.0, "openmpi", "from-env-file"], [1, 2, 1.0, "openmpi", "from-env-file"]]


def test_inside_a_slurm_allocation_meshspeed_run_uses_srun(tmp_path, fakes):
    env = {**fakes, "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "localhost", "SLURM_NTASKS_PER_NODE": "2"}
    done = _meshspeed(tmp_path, env, "--force_multi", "--master_port", _free_port(), "train.py")
    assert done.returncode == 0, done.stderr
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[1:7] == ["-N", "1", "--ntasks-per-node", "2", "--nodelist", "localhost"]
    assert _ranks(tmp_path, 2) == [[0, 2, 1.0, "slurm", "from-env-file"], [1, 2, 1.0, "slurm", "from-env-file"]]


def test_plain_srun_python_train_py(tmp_path, fakes):
    """No meshspeed run at all: srun starts the ranks, init_distributed reads SLURM_*."""
    env = {**fakes, "MASTER_PORT": _free_port()}
    done = subprocess.run(["srun", "-N", "1", "--ntasks-per-node", "2", "--nodelist", "localhost", "--chdir",
                           str(tmp_path), sys.executable, "train.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert [r[:4] for r in _ranks(tmp_path, 2)] == [[0, 2, 1.0, "slurm"], [1, 2, 1.0, "slurm"]]
