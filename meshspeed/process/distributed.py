"""Starting torch.distributed from whatever launched this process.

``detect_launch_env`` reads the environment of one of the launchers we understand --
torchrun (or anything else that sets RANK/WORLD_SIZE), Slurm's srun, Open MPI's mpirun,
MPICH/Intel MPI -- and is pure, so each launcher's conventions are tested without one.
``init_distributed`` turns that into a default process group.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import gc
import logging
import os
import re
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist

from meshspeed.comm import collectives, registry, rollcall, sequence
from meshspeed.process.accelerator import Accelerator, get_accelerator
from meshspeed.process.stopped import install_stop_report

logger = logging.getLogger(__name__)

DEFAULT_PORT = 29500
LAUNCHER_NAMES = {
    "torchrun": "torchrun",
    "env": "RANK/WORLD_SIZE environment variables",
    "slurm": "Slurm",
    "openmpi": "Open MPI",
    "pmi": "MPICH/Intel MPI (PMI)",
    "explicit": "init_distributed arguments",
    "none": "no launcher",
}

class ProcessGroupMissingError(RuntimeError, AssertionError):
    """`dist_init_required=False` said the caller made the process group, and none exists.
    An AssertionError too, as DeepSpeed's (Note [DeepSpeed's exception types] in
    meshspeed/engine/errors.py)."""


# How the current process group was started; read only by describe_world/get_local_rank.
_launch_env: LaunchEnv | None = None


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as its launcher described it."""

    launcher: str  # a key of LAUNCHER_NAMES
    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None  # None: must be supplied (MASTER_ADDR) before init
    master_port: int | None  # None: not given; init_distributed picks (free port if alone)
    world_size_source: str = ""  # the variable world_size came from, for messages

    def describe(self) -> str:
        """One phrase saying how the world size was found, e.g. "WORLD_SIZE=4 from torchrun"."""
        if self.launcher == "none" and self.world_size == 1:
            return "1 process, no launcher"
        return f"{self.world_size_source}={self.world_size} from {LAUNCHER_NAMES[self.launcher]}"


def detect_launch_env(environ: Mapping[str, str]) -> LaunchEnv:
    """Read rank, world size, local rank and rendezvous address from ``environ``.

    Precedence: RANK/WORLD_SIZE (torchrun and most launchers set them), then Slurm
    (SLURM_PROCID), then Open MPI (OMPI_COMM_WORLD_RANK), then PMI (PMI_RANK), else a
    single process with no launcher. MASTER_ADDR/MASTER_PORT override what a launcher's
    variables imply.
    """
    addr = environ.get("MASTER_ADDR")
    port = _int(environ, "MASTER_PORT") if "MASTER_PORT" in environ else None
    if "RANK" in environ and "WORLD_SIZE" in environ:
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in environ else "env"
        return LaunchEnv(launcher, _int(environ, "RANK"), _int(environ, "WORLD_SIZE"),
                         _int(environ, "LOCAL_RANK", 0), addr, port, "WORLD_SIZE")
    if "SLURM_PROCID" in environ:
        # Inside an srun step, SLURM_STEP_NUM_TASKS counts this step's processes;
        # SLURM_NTASKS is the allocation's, which is the same for a plain `srun python ...`.
        for size_var in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"):
            if size_var in environ:
                break
        else:
            raise ValueError("SLURM_PROCID is set but none of SLURM_STEP_NUM_TASKS, "
                             "SLURM_NTASKS, SLURM_NPROCS is")
        if addr is None:
            addr = environ.get("SLURM_LAUNCH_NODE_IPADDR") or first_slurm_host(
                environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
                or environ.get("SLURM_NODELIST") or "")
        return LaunchEnv("slurm", _int(environ, "SLURM_PROCID"), _int(environ, size_var),
                         _int(environ, "SLURM_LOCALID", 0), addr, port or DEFAULT_PORT, size_var)
    if "OMPI_COMM_WORLD_RANK" in environ:
        world = _int(environ, "OMPI_COMM_WORLD_SIZE")
        if addr is None and _int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE", -1) == world:
            addr = "127.0.0.1"  # every rank on this node
        return LaunchEnv("openmpi", _int(environ, "OMPI_COMM_WORLD_RANK"), world,
                         _int(environ, "OMPI_COMM_WORLD_LOCAL_RANK", 0), addr,
                         port or DEFAULT_PORT, "OMPI_COMM_WORLD_SIZE")
    if "PMI_RANK" in environ and "PMI_SIZE" in environ:
        return LaunchEnv("pmi", _int(environ, "PMI_RANK"), _int(environ, "PMI_SIZE"),
                         _int(environ, "MPI_LOCALRANKID", 0), addr, port or DEFAULT_PORT,
                         "PMI_SIZE")
    return LaunchEnv("none", 0, 1, 0, addr or "127.0.0.1", port, "")


def first_slurm_host(nodelist: str) -> str | None:
    """First host of a Slurm node list: "gpu[003-010,015],cpu1" -> "gpu003".

    Handles the compressed form Slurm prints (bracketed ranges, zero padding, several
    bracket groups); returns None for an empty list.
    """
    first = re.split(r",(?![^\[]*\])", nodelist.strip())[0]  # split on commas outside [...]
    if not first:
        return None
    # In each [..] keep its first item and that item's first number: "[003-010,015]" -> "003"
    return re.sub(r"\[([^,\-\]]+)[^\]]*\]", r"\1", first)


# Note [one store, several attempts]
# Under torchrun the workers' rendezvous store is the agent's (TORCHELASTIC_USE_AGENT_STORE),
# and it outlives the workers: with --max-restarts, the restarted group meets in the same
# store, under the same keys, as the group that died. A restarted rank can then read its
# peer's address from the dead attempt and fail to connect ("Gloo connectFullMesh failed
# ... Connection refused"), ending the job at its first restart; on a busy 2-core machine
# 4 restarts of 5 did with the static rendezvous, 1 of 4 with c10d (--standalone). So under the agent's
# store, init_distributed connects to it itself and keeps each attempt's keys under
# their own prefix: the rendezvous round every host agrees on where `meshspeed run` exports
# it, else torchrun's restart counter (Note [attempts every host agrees on] in comm/registry.py).
def _attempt_store(env, timeout: datetime.timedelta):
    """The agent's store, under this attempt's prefix; None outside torchrun's agent store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or env.master_addr is None:
        return None
    attempt = registry.attempt()
    store = dist.TCPStore(str(env.master_addr), int(env.master_port), env.world_size,
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"meshspeed/attempt_{attempt}", store)


def init_distributed(
    backend: str | None = None,
    timeout: datetime.timedelta | float = datetime.timedelta(minutes=5),
    *,
    dist_backend: str | None = None,
    init_method: str | None = None,
    rank: int = -1,
    world_size: int = -1,
    verbose: bool = True,
    accelerator: Accelerator | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int | None = None,
    dist_init_required: bool | None = None,
    config: object | None = None,
) -> None:
    """Create the default process group from the launcher's environment; no-op if one exists.

    ``backend`` (or DeepSpeed's ``dist_backend``) defaults to NCCL when CUDA is available
    and gloo otherwise; ``timeout`` is a timedelta or seconds. Explicit ``rank`` /
    ``world_size`` (>= 0) override the environment. Sets the CUDA device to the local rank
    and fills in RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT where unset, so that
    code reading them (DeviceMesh, data loaders) agrees with the process group.

    Accepted for DeepSpeed compatibility: ``distributed_port`` (the port used when
    MASTER_PORT is unset and there is more than one process; a lone process takes a free
    port), ``dist_init_required=False`` (the caller made the process group: adopt it, and
    raise ``ProcessGroupMissingError`` when there is none, as DeepSpeed does),
    ``auto_mpi_discovery`` and ``config`` (ignored: MPI ranks are read from the
    environment, not from mpi4py).
    """
    del auto_mpi_discovery, config
    if dist.is_initialized():
        adopt_process_group()  # Note [a process group the caller made]
        return
    if dist_init_required is False:
        raise ProcessGroupMissingError(
            "dist_init_required=False but torch.distributed has no process group: create it first "
            "(torch.distributed.init_process_group) or leave dist_init_required unset so that "
            "meshspeed creates it")
    if backend and dist_backend and backend != dist_backend:
        raise ValueError(f"backend {backend!r} and dist_backend {dist_backend!r} disagree")
    backend = backend or dist_backend
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))

    env = _resolve(detect_launch_env(os.environ), rank, world_size, distributed_port)
    if init_method is None or init_method.startswith("env://"):
        if env.master_addr is None:
            raise RuntimeError(f"cannot find the rendezvous address for {env.describe()}: "
                               "set MASTER_ADDR to the host of rank 0")
        for key, value in (("MASTER_ADDR", env.master_addr), ("MASTER_PORT", env.master_port),
                           ("RANK", env.rank), ("WORLD_SIZE", env.world_size),
                           ("LOCAL_RANK", env.local_rank)):
            os.environ.setdefault(key, str(value))

    accelerator = accelerator or get_accelerator()
    backend = backend or accelerator.default_backend()
    if accelerator.name == "cuda":
        accelerator.set_device(env.local_rank)
    store = _attempt_store(env, timeout) if init_method is None else None
    if store is not None:  # Note [one store, several attempts]
        dist.init_process_group(backend, store=store, timeout=timeout, rank=env.rank,
                                world_size=env.world_size)
    else:
        dist.init_process_group(backend, init_method=init_method, timeout=timeout, rank=env.rank,
                                world_size=env.world_size)
    global _launch_env
    _launch_env = env
    adopt_process_group()
    if verbose and env.rank == 0:
        logger.info("meshspeed: %s process group, %s", backend, env.describe())


# Note [a process group the caller made]
# accelerate, torchrun scripts and `deepspeed.init_distributed` often create the default
# process group themselves (`dist.init_process_group`). Such a group gets what meshspeed gives
# its own: this rank's host and process posted to the store for the roll call (so a hang
# report names the missing rank, and a dead one as dead), the report of the place a rank
# was stopped by the launcher, and the clean teardown at exit. `adopt_process_group` does
# it once per default group, whoever made it: `init_distributed` calls it after making one,
# or when it finds one, and `meshspeed.initialize` when the group exists already. The comms
# timeout is the config's (`comms_timeout`), set by `initialize` for every group alike.
_adopted: list[int] = []  # id of the default group adopted


def adopt_process_group() -> None:
    """Note [a process group the caller made]; idempotent."""
    world = dist.group.WORLD
    if _adopted == [id(world)]:
        return
    _adopted[:] = [id(world)]
    rollcall.introduce()
    install_stop_report()  # Note [naming the dead rank when torchrun stops the job]
    atexit.unregister(_shutdown)  # once per process, whichever group was adopted last
    atexit.register(_shutdown)


def _resolve(env: LaunchEnv, rank: int, world_size: int, distributed_port: int | None) -> LaunchEnv:
    """Apply init_distributed's explicit arguments and pick the port."""
    if world_size >= 0 and world_size != env.world_size:
        env = dataclasses.replace(env, launcher="explicit", world_size=world_size,
                                  world_size_source="world_size")
    if rank >= 0:
        env = dataclasses.replace(env, rank=rank)
    if "MASTER_PORT" in os.environ:
        port = env.master_port
    elif env.world_size == 1:  # a lone process takes any free port, so runs never collide
        port = _free_port()
    elif distributed_port is not None:
        port = distributed_port
    else:  # a group must agree on a fixed port
        port = env.master_port or DEFAULT_PORT
    return dataclasses.replace(env, master_port=port)


def _shutdown() -> None:
    """Destroy the process group we created before the interpreter tears down: exiting
    with gloo's threads still alive can abort the process ("terminate called without an
    active exception") after a run that otherwise succeeded."""
    if dist.is_initialized():
        rollcall.post_exit(sequence.issued_by_group())  # Note [roll call]: peers still waiting learn why
        try:
            if dist.get_backend() == "gloo" and getattr(sys, "last_type", None) is None:
                # tear down together: a peer that vanished mid-teardown can abort gloo's
                # threads. Skipped after an uncaught exception (sys.last_type is set), so a
                # failing rank exits at once; a peer that died makes this fail in 10 s.
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=10))
                _quiesce()
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001, S110 - best effort at exit
            pass


def _quiesce() -> None:
    """Leave gloo's worker threads idle while the interpreter can still run their frees
    (Note [the last collectives' tensors outlive their work] in comm/collectives.py):
    destroy_process_group does not stop them while anything references the group, so
    without this a work finishing during interpreter exit aborts the process."""
    collectives.finish_outstanding()  # every peer passed the barrier: all sides are issued
    dist.barrier()  # gloo's barrier waits for the works still in progress
    gc.collect()  # free engine cycles now, not in the interpreter's last collection


def describe_world() -> str:
    """How the world size was (or would be) found, for error messages:
    "WORLD_SIZE=4 from torchrun", "1 process, no launcher", ..."""
    env = detect_launch_env(os.environ) if _launch_env is None else _launch_env
    if dist.is_initialized() and dist.get_world_size() != env.world_size:
        return f"WORLD_SIZE={dist.get_world_size()} from an existing process group"
    return env.describe()


def get_local_rank() -> int:
    """This process's index on its node, as the launcher set it (0 without a launcher)."""
    env = detect_launch_env(os.environ) if _launch_env is None else _launch_env
    return env.local_rank


# what launchers call the number of processes on this node
_LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")


def get_local_world_size() -> int:
    """Processes per node, as the launcher set it; without one, the whole world is one node
    (node i holds global ranks [i L, (i+1) L), as launchers place them)."""
    for var in _LOCAL_SIZE_VARS:
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return dist.get_world_size() if dist.is_initialized() else 1


def _int(environ: Mapping[str, str], key: str, default: int | None = None) -> int:
    value = environ.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"environment variable {key} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {key}={value!r} is not an integer") from None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
