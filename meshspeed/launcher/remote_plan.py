"""The commands of a launch on several hosts: pure functions of a `RemoteJob`, no processes.

    ssh (default)   one `ssh host 'cd CWD && exec env VARS python -m meshspeed.launcher.guard
                    -- python -m meshspeed.cli run --nnodes N ... script.py'` per host
    pdsh            one `pdsh -w host,host ...` running the same command on every host
    openmpi         one `mpirun -np W --host h:k,... -x VARS python -u script.py`
    slurm           one `srun -N n --ntasks-per-node k --nodelist h,... --export ALL,VARS
                    python -u script.py`

Under ssh and pdsh every host runs its share through torchrun with the c10d rendezvous
at the master (Note [c10d rendezvous across hosts]); under mpirun and srun every rank is a
plain process that meshspeed.init_distributed places from OMPI_* / SLURM_* variables.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

LAUNCHERS = ("ssh", "pdsh", "openmpi", "slurm")
PREFIX_TEMPLATE = "[{host} r${{rank}}] "  # torchrun fills ${rank} (the global rank)

# Note [c10d rendezvous across hosts]
# Every host's torchrun agent meets at `--rdzv-endpoint master:port` (the agent on the
# master hosts the store) under one `--rdzv-id`; the rendezvous round, which every host
# agrees on, numbers the attempts (so restarts can key on it rather than on the per-node
# restart counter). torch 2.13's agents by default share the rendezvous TCP store with the
# workers, and cache where that store is (`_bootstrap_store_info` in
# torch/distributed/elastic/rendezvous/dynamic_rendezvous.py) from the first round they
# joined: a later round only publishes MASTER_ADDR/MASTER_PORT under its own key prefix
# when some agent has no cached copy yet. When the membership changes -- a host joins
# (growing, or a relaunched host) -- the new round's rank 0 may be an agent that cached
# the old round's info: it publishes nothing, and the newcomer waits on
# `store.get("MASTER_ADDR")` in the new round until DistStoreError ends it; or the
# newcomer is rank 0, serves a new store, and the old agents send their workers to the old
# one. Either way the job deadlocks. Every host runs `meshspeed run`, whose rendezvous
# wrapper has each round's rank 0 post the store's address and every other agent take it
# (Note [the bootstrap store of a joining host] in rounds.py), rather than setting
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: that gives each attempt a store of its own, hosted by
# worker rank 0 and lost with it, and the host registry must outlive an attempt.


@dataclass
class RemoteJob:
    """One job over several hosts, as the launching machine sees it."""

    hosts: dict[str, int]  # host -> processes on it, in launch order (the first is node 0)
    master_addr: str  # where the rendezvous is (default: the first host)
    master_port: int
    job_id: str  # the rendezvous id every host uses
    python: str  # the interpreter every host runs (the launching one: same image everywhere)
    cwd: str  # every host starts here
    target: list[str]  # the script (or -m module) and its arguments
    launcher: str = "ssh"
    nnodes: str | None = None  # "N" or "MIN:MAX"; None: every host
    ssh_port: int | None = None
    exports: dict[str, str] = field(default_factory=dict)  # sent to every host
    host_env: dict[str, dict[str, str]] = field(default_factory=dict)  # per host (CUDA_VISIBLE_DEVICES)
    torchrun_options: list[str] = field(default_factory=list)  # the user's (--max-restarts ...)
    run_options: list[str] = field(default_factory=list)  # meshspeed run's own (--deepspeed-compat)

    @property
    def world_size(self) -> int:
        return sum(self.hosts.values())


def _quote(words: list[str]) -> str:
    return " ".join(shlex.quote(w) for w in words)


def node_argv(job: RemoteJob, host: str) -> list[str]:
    """What one host runs under ssh/pdsh: its share through `meshspeed run` (torchrun). No
    --node-rank: the c10d rendezvous numbers the hosts itself (torchrun ignores one)."""
    nnodes = job.nnodes or str(len(job.hosts))
    return [job.python, "-u", "-m", "meshspeed.cli", "run",
            "--nproc-per-node", str(job.hosts[host]), "--nnodes", nnodes,
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{job.master_addr}:{job.master_port}",
            "--rdzv-id", job.job_id, "--tee", "3", *job.run_options, *job.torchrun_options, *job.target]


def node_env(job: RemoteJob, host: str, label: str | None = None) -> dict[str, str]:
    """The environment one host's `meshspeed run` gets on top of its own; `label` names the
    host in its output lines (default: the host's name)."""
    return {**job.exports, **job.host_env.get(host, {}),
            "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": PREFIX_TEMPLATE.format(host=label or host)}


def remote_command(job: RemoteJob, host: str, *, label: str | None = None,
                   watch_stdin: bool = True) -> str:
    """The shell line one host runs: its share, under the guard (meshspeed/launcher/guard.py)
    that stops every process of it when the connection to the launcher ends."""
    env = [f"{k}={v}" for k, v in node_env(job, host, label).items()]
    guard = [job.python, "-u", "-m", "meshspeed.launcher.guard", "--host", label or host]
    guard += [] if watch_stdin else ["--no-stdin"]
    return (f"cd {shlex.quote(job.cwd)} && exec env {_quote(env)} "
            f"{_quote([*guard, '--', *node_argv(job, host)])}")


def ssh_options(job: RemoteJob) -> list[str]:
    return ["-o", "BatchMode=yes"] + (["-p", str(job.ssh_port)] if job.ssh_port else [])


def ssh_argv(job: RemoteJob, host: str) -> list[str]:
    """One host's ssh command (`-T`: no terminal; the guard watches ssh's stdin instead)."""
    return ["ssh", "-T", *ssh_options(job), host,
            remote_command(job, host)]


def preflight_argv(job: RemoteJob, host: str) -> list[str]:
    """One host's check of the master address (meshspeed/launcher/preflight.py)."""
    env = [f"{k}={v}" for k, v in job.exports.items()]
    check = [job.python, "-m", "meshspeed.launcher.preflight", job.master_addr]
    return ["ssh", "-T", *ssh_options(job), host,
            f"cd {shlex.quote(job.cwd)} && exec env {_quote(env)} {_quote(check)}"]


def pdsh_argv(job: RemoteJob) -> tuple[list[str], dict[str, str]]:
    """(argv, environment for pdsh): one command for every host, pdsh putting in the host's
    name for %h. pdsh keeps each ssh's stdin open and silent, so the guard's stdin closes
    when pdsh kills that ssh (its abort), as under the ssh launcher."""
    sizes = set(job.hosts.values())
    if len(sizes) != 1:
        raise ValueError("pdsh runs one command on every host, and the hosts have different "
                         f"slot counts {sorted(sizes)}; use --launcher ssh")
    command = remote_command(job, next(iter(job.hosts)), label="%h")
    pdsh_env = {"PDSH_RCMD_TYPE": "ssh"}
    if job.ssh_port:
        pdsh_env["PDSH_SSH_ARGS_APPEND"] = f"-p {job.ssh_port}"
    return ["pdsh", "-S", "-f", "1024", "-w", ",".join(job.hosts), command], pdsh_env


def _rank_target(job: RemoteJob) -> list[str]:
    """A rank under mpirun/srun: the script itself, unbuffered (no torchrun in between)."""
    return [job.python, "-u", *job.run_options, *job.target]


def mpirun_argv(job: RemoteJob) -> list[str]:
    """One mpirun for the whole job; each rank finds its place in OMPI_* variables."""
    env = {**job.exports, "MASTER_ADDR": job.master_addr, "MASTER_PORT": str(job.master_port)}
    argv = ["mpirun", "-np", str(job.world_size), "--host", ",".join(f"{h}:{n}" for h, n in job.hosts.items())]
    if job.ssh_port:
        argv += ["--mca", "plm_rsh_args", f"-p {job.ssh_port}"]
    for key, value in env.items():
        argv += ["-x", f"{key}={value}"]
    return [*argv, "--wdir", job.cwd, *_rank_target(job)]


def srun_argv(job: RemoteJob) -> list[str]:
    """One srun for the whole job; each rank finds its place in SLURM_* variables."""
    sizes = set(job.hosts.values())
    if len(sizes) != 1:
        raise ValueError("srun --ntasks-per-node runs the same number of processes on every host; "
                         f"the hosts have {sorted(sizes)}")
    env = {**job.exports, "MASTER_ADDR": job.master_addr, "MASTER_PORT": str(job.master_port)}
    bad = [k for k, v in env.items() if "," in v]
    if bad:
        raise ValueError(f"srun --export cannot carry values with commas ({', '.join(bad)}); "
                         "export them in the job script instead")
    export = ",".join(["ALL", *(f"{k}={v}" for k, v in env.items())])
    return ["srun", "-N", str(len(job.hosts)), "--ntasks-per-node", str(sizes.pop()),
            "--nodelist", ",".join(job.hosts), "--chdir", job.cwd, "--export", export, *_rank_target(job)]
