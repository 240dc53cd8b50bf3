"""The `deepspeed` launcher's options, as torchrun options. Pure functions: no processes.

    deepspeed --num_gpus 2 train.py ...            meshspeed run --num_gpus 2 train.py ...
    deepspeed --include localhost:1,3 train.py     2 processes, CUDA_VISIBLE_DEVICES=1,3
    deepspeed --hostfile hosts --node_rank 1 \\
        --master_addr node0 --no_ssh train.py      this node's share of a multi-node job

Resources are hosts with device slots: a hostfile (``worker-1 slots=4`` per line), or
without one this machine (``localhost``, its CUDA devices). `--include` / `--exclude`
(``host[:slot,slot][@host...]``) or `--num_nodes` / `--num_gpus` narrow them, as in
DeepSpeed. One host: torchrun runs its slots here. Several hosts (or `--force_multi`): with
`--node_rank` it runs that node's share here (DeepSpeed's `--no_ssh` mode), otherwise the
plan names every host's share (`LaunchPlan.hosts`) for a launcher (remote_plan.py) to
start. Inside a Slurm allocation without a hostfile the hosts are the allocation's
(slurm_hosts.py) and the launcher is srun.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from meshspeed.launcher import slurm_hosts
from meshspeed.launcher.remote_plan import LAUNCHERS

LOCALHOST = "localhost"
DEFAULT_PORT = 29500

# Flags of the deepspeed launcher that have no meaning here, with the reason given.
UNSUPPORTED = {
    "--autotuning": "`meshspeed run` tunes before launching; launch_plan takes no tuning",
}


class LaunchError(ValueError):
    """A launcher option that cannot be honoured; the message says which and why."""


@dataclass
class DeepSpeedFlags:
    """The deepspeed launcher's options as given (None / False: not given)."""

    num_gpus: int | None = None
    num_nodes: int | None = None
    include: str = ""
    exclude: str = ""
    hostfile: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    node_rank: int | None = None
    no_ssh: bool = False
    launcher: str | None = None  # ssh (default) | pdsh | openmpi | slurm
    ssh_port: int | None = None
    force_multi: bool = False  # start through the launcher even for one host


@dataclass
class LaunchPlan:
    """What torchrun is told, for this node; or, when the job is started on several hosts
    through a launcher (several hosts and no --node_rank, or --force_multi), `hosts` and
    what goes with them instead."""

    nproc_per_node: int | None = None  # None: no resource option given, meshspeed run's default
    torchrun_options: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    hosts: dict[str, int] = field(default_factory=dict)  # host -> processes; set: launch remotely
    host_env: dict[str, dict[str, str]] = field(default_factory=dict)  # per host (CUDA_VISIBLE_DEVICES)
    master_addr: str | None = None  # with hosts: where they meet (default: the first host)
    master_port: int = DEFAULT_PORT
    launcher: str = "ssh"


def parse_hostfile(text: str, source: str = "hostfile") -> dict[str, int]:
    """``host slots=N`` lines -> {host: N}, in file order; '#' starts a comment."""
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"(\S+)\s+slots\s*=\s*(\d+)", line)
        if match is None:
            raise LaunchError(f"{source}:{number}: expected 'hostname slots=N', got {raw.strip()!r}")
        host, slots = match.group(1), int(match.group(2))
        if host in hosts:
            raise LaunchError(f"{source}:{number}: host {host!r} is listed twice")
        if slots < 1:
            raise LaunchError(f"{source}:{number}: {host} has slots={slots}; need at least 1")
        hosts[host] = slots
    if not hosts:
        raise LaunchError(f"{source}: no hosts in it (lines look like 'worker-1 slots=4')")
    return hosts


def parse_filter(spec: str, flag: str) -> dict[str, list[int] | None]:
    """``"worker-1:0,1@worker-2"`` -> {"worker-1": [0, 1], "worker-2": None (every slot)}."""
    out: dict[str, list[int] | None] = {}
    for part in filter(None, spec.split("@")):
        host, _, slots = part.partition(":")
        if not host:
            raise LaunchError(f"{flag} {spec!r}: {part!r} has no host name")
        try:
            out[host] = sorted({int(s) for s in slots.split(",")}) if slots else None
        except ValueError:
            raise LaunchError(f"{flag} {spec!r}: slots of {host} must be integers, e.g. {host}:0,1") from None
    if not out:
        raise LaunchError(f"{flag}: empty; write host[:slot,...][@host...], e.g. localhost:0,1")
    return out


def select(resources: dict[str, list[int]], include: str = "", exclude: str = "",
           check_slots: bool = True) -> dict[str, list[int]]:
    """The hosts and slots left by --include (only these) or --exclude (all but these)."""
    if include and exclude:
        raise LaunchError("--include and --exclude cannot be combined; give one")
    flag, spec = ("--include", include) if include else ("--exclude", exclude)
    if not spec:
        return {h: list(s) for h, s in resources.items()}
    chosen = parse_filter(spec, flag)
    for host, slots in chosen.items():
        if host not in resources:
            raise LaunchError(f"{flag}: host {host!r} is not among the available hosts {list(resources)}")
        missing = [s for s in slots or [] if s not in resources[host]]
        if check_slots and missing:
            raise LaunchError(f"{flag}: {host} has no slot(s) {missing}; available: {resources[host]}")
    if include:
        out = {h: (list(resources[h]) if s is None else s) for h, s in chosen.items()}
        return {h: out[h] for h in resources if h in out}  # hostfile order
    out = {}
    for host, slots in resources.items():
        if host in chosen:
            slots = [] if chosen[host] is None else [s for s in slots if s not in chosen[host]]
        if slots:
            out[host] = slots
    if not out:
        raise LaunchError(f"--exclude {exclude!r} leaves no slots to run on")
    return out


def _visible(slots: list[int], visible_devices: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for these slots; slot i is the i-th device visible now."""
    if not visible_devices:
        return ",".join(map(str, slots))
    current = [d.strip() for d in visible_devices.split(",") if d.strip()]
    if max(slots) >= len(current):
        raise LaunchError(f"slot {max(slots)} requested but CUDA_VISIBLE_DEVICES={visible_devices} "
                          f"shows {len(current)} device(s); slots count the visible devices")
    return ",".join(current[s] for s in slots)


def plan(flags: DeepSpeedFlags, *, device_count: int, hostfile_text: str | None = None,
         environ: Mapping[str, str] | None = None) -> LaunchPlan:
    """Turn deepspeed launcher flags into torchrun options for this node.

    `device_count` is the number of CUDA devices here (0: CPU, where a slot is a process);
    `hostfile_text` the content of --hostfile; `environ` this process's environment
    (CUDA_VISIBLE_DEVICES, a Slurm allocation's variables)."""
    environ = environ or {}
    if flags.launcher is not None and flags.launcher not in LAUNCHERS:
        raise LaunchError(f"--launcher {flags.launcher}: meshspeed run starts hosts with one of "
                          f"{', '.join(LAUNCHERS)}")
    filtered = bool(flags.include or flags.exclude)
    if filtered and (flags.num_gpus is not None or flags.num_nodes is not None):
        raise LaunchError("--num_gpus/--num_nodes cannot be combined with --include/--exclude; "
                          "say which slots to use in one way")
    for name in ("num_gpus", "num_nodes"):
        value = getattr(flags, name)
        if value is not None and value < 1:
            raise LaunchError(f"--{name} {value}: need at least 1")
    slurm = flags.hostfile is None and flags.node_rank is None and not flags.no_ssh \
        and slurm_hosts.in_allocation(environ)
    if flags.hostfile is not None:
        resources = {h: list(range(n)) for h, n in
                     parse_hostfile(hostfile_text or "", flags.hostfile).items()}
    elif slurm:
        try:
            found = slurm_hosts.allocation_hosts(environ, flags.num_gpus, device_count)
        except slurm_hosts.NodeListError as err:
            raise LaunchError(str(err)) from None
        resources = {h: list(range(n)) for h, n in found.items()}
        flags = _with_default_launcher(flags, "slurm")
    else:
        if flags.num_nodes is not None and flags.num_nodes > 1:
            return _multi_node_without_hostfile(flags, device_count)
        local = list(range(device_count)) if device_count else list(range(flags.num_gpus or 1))
        if filtered and not device_count:  # CPU: a slot is a process, any index will do
            flag = "--include" if flags.include else "--exclude"
            chosen = parse_filter(flags.include or flags.exclude, flag)
            local = sorted(set(local) | {s for slots in chosen.values() for s in slots or []})
        resources = {LOCALHOST: local}
    check = bool(device_count) or flags.hostfile is not None or slurm  # CPU, no hostfile: any slot
    hosts = select(resources, flags.include, flags.exclude, check_slots=check)
    if flags.num_nodes is not None:
        if flags.num_nodes > len(hosts):
            raise LaunchError(f"--num_nodes {flags.num_nodes}: the hostfile has {len(hosts)} host(s)")
        hosts = dict(list(hosts.items())[: flags.num_nodes])
    if flags.num_gpus is not None:
        if device_count and flags.hostfile is None and not slurm and flags.num_gpus > device_count:
            raise LaunchError(f"--num_gpus {flags.num_gpus}: this machine has {device_count} CUDA device(s)")
        hosts = {h: list(range(flags.num_gpus)) for h in hosts}
    if len(hosts) == 1 and not flags.force_multi:
        slots = next(iter(hosts.values()))
        counted = filtered or flags.num_gpus is not None or flags.hostfile is not None or slurm
        out = LaunchPlan(nproc_per_node=len(slots) if counted else None,
                         torchrun_options=_rendezvous(flags, None))
        if filtered and device_count:
            out.env["CUDA_VISIBLE_DEVICES"] = _visible(slots, environ.get("CUDA_VISIBLE_DEVICES"))
        return out
    return _multi_host(flags, hosts, filtered, environ)


def _rendezvous(flags: DeepSpeedFlags, nnodes: int | None, master_addr: str | None = None,
                node_rank: int | None = None) -> list[str]:
    opts = []
    if nnodes is not None:
        opts += ["--nnodes", str(nnodes)]
    node_rank = flags.node_rank if node_rank is None else node_rank
    if node_rank is not None:
        opts += ["--node-rank", str(node_rank)]
    addr = master_addr or flags.master_addr
    if addr is not None:
        opts += ["--master-addr", addr]
    if flags.master_port is not None or nnodes is not None:
        opts += ["--master-port", str(flags.master_port or DEFAULT_PORT)]
    return opts


def _multi_node_without_hostfile(flags: DeepSpeedFlags, device_count: int) -> LaunchPlan:
    """`--num_nodes N` with no hostfile: torchrun's multi-node form, one command per node."""
    if flags.master_addr is None or flags.node_rank is None:
        raise LaunchError(f"--num_nodes {flags.num_nodes} without a hostfile: run meshspeed run on every "
                          "node with --node_rank (0.. on each) and --master_addr (node 0's address)")
    nproc = flags.num_gpus or device_count or 1
    return LaunchPlan(nproc_per_node=nproc, torchrun_options=_rendezvous(flags, flags.num_nodes))


def _with_default_launcher(flags: DeepSpeedFlags, launcher: str) -> DeepSpeedFlags:
    return flags if flags.launcher is not None else DeepSpeedFlags(**{**vars(flags), "launcher": launcher})


def _multi_host(flags, hosts, filtered, environ) -> LaunchPlan:
    sizes = {len(s) for s in hosts.values()}
    uneven_ok = flags.node_rank is None and flags.launcher in ("ssh", None, "openmpi")
    if len(sizes) != 1 and not uneven_ok:
        raise LaunchError(f"hosts with different slot counts {[(h, len(s)) for h, s in hosts.items()]}: "
                          "torchrun runs the same number of processes on every node with --node_rank, "
                          "and so do pdsh and srun; start with the ssh or openmpi launcher")
    names = list(hosts)
    master = flags.master_addr or names[0]
    if flags.node_rank is not None:
        if not 0 <= flags.node_rank < len(names):
            raise LaunchError(f"--node_rank {flags.node_rank}: the job has {len(names)} nodes (0..{len(names) - 1})")
        return _node_plan(flags, hosts, names, flags.node_rank, master, filtered, environ)
    if flags.no_ssh:
        raise LaunchError("--no_ssh with several hosts needs --node_rank (this node's index in the hostfile)")
    # CUDA_VISIBLE_DEVICES here says nothing about the other nodes' devices: slots count theirs
    host_env = {h: {"CUDA_VISIBLE_DEVICES": _visible(s, None)} for h, s in hosts.items()} if filtered else {}
    return LaunchPlan(hosts={h: len(s) for h, s in hosts.items()}, host_env=host_env, master_addr=master,
                      master_port=flags.master_port or DEFAULT_PORT, launcher=flags.launcher or "ssh")


def _node_plan(flags, hosts, names, rank, master, filtered, environ) -> LaunchPlan:
    slots = hosts[names[rank]]
    out = LaunchPlan(nproc_per_node=len(slots),
                     torchrun_options=_rendezvous(flags, len(names), master, rank))
    if filtered:
        out.env["CUDA_VISIBLE_DEVICES"] = _visible(slots, (environ or {}).get("CUDA_VISIBLE_DEVICES"))
    return out
