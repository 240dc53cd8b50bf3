"""`meshspeed run`: start a training script on N processes per node, through torchrun.

This is a front over ``torch.distributed.run`` (torchrun), not a launcher of our own:
torchrun already does rendezvous, restarts, per-rank logs and multi-node. We add one
default -- ``--nproc-per-node`` is the number of CUDA devices, or 1 without CUDA -- and
forward every other argument unchanged, so any torchrun option works here::

    meshspeed run --nproc-per-node 2 train.py --lr 3e-4
    meshspeed run --nnodes 2 --node-rank 0 --master-addr node0 train.py

The `deepspeed` launcher's options are understood too (ds_launcher.py maps them), and
``--deepspeed-compat`` runs a script written for DeepSpeed without changing it::

    meshspeed run --deepspeed-compat --num_gpus 2 train.py --deepspeed --deepspeed_config ds.json

In that mode `import deepspeed` is meshspeed in the launched processes (Note [the deepspeed
alias] in meshspeed/compat/alias.py) and each process gets DeepSpeed's ``--local_rank=N``
argument (meshspeed/compat/child.py; ``--no_local_rank`` leaves it out).

Several hosts start from one command (docs/multinode.md)::

    meshspeed run --hostfile hostfile [--launcher ssh|pdsh|openmpi|slurm] train.py

Before any process starts, the script (or -m module) is checked. Each rank runs under
rank_entry.py, and a failed job ends with the first failing rank's cause as the last line,
once, in place of torchrun's failure block (failures.py)::

    meshspeed run: rank 1 failed first: ConfigError: tensor_parallel.autotp_size: 3 does not ...

multinode.py makes the job, remote_plan.py its commands, remote_run.py runs them; inside a
Slurm allocation the hosts are its nodes (slurm_hosts.py). ``--nnodes MIN:MAX`` with
--master_addr is made into the c10d rendezvous (elastic.py).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.machinery
import importlib.util
import itertools
import os
import shutil
import sys
import tempfile
from typing import NamedTuple

import torch
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
from torch.distributed.run import get_args_parser
from torch.distributed.run import main as torchrun_main

from meshspeed.autotune.trial import TuneError, substitute
from meshspeed.autotune.tuner import autotune
from meshspeed.compat.install import write_shim
from meshspeed.config import ConfigError
from meshspeed.launcher import (
    ds_launcher,
    elastic,
    failures,
    multinode,
    remote_run,
    rounds,
    slurm_hosts,
)
from meshspeed.launcher.ds_launcher import DeepSpeedFlags, LaunchError
from meshspeed.launcher.remote_plan import RemoteJob

PASSTHROUGH = True  # meshspeed.cli hands options it does not know to us as `args.extra`

# (option strings, argparse keywords); `native` ones torchrun also has under these names
_DS_OPTIONS = [
    (("--num_gpus", "--num-gpus"), {"type": int, "help": "processes (devices) per node"}),
    (("--num_nodes", "--num-nodes"), {"type": int, "help": "number of nodes to use"}),
    (("--include",), {"default": "", "help": "only these resources: host[:slot,...][@host...], "
                                             "e.g. localhost:0,1"}),
    (("--exclude",), {"default": "", "help": "every resource but these (same format as --include)"}),
    (("--hostfile",), {"help": "DeepSpeed hostfile ('host slots=N' per line)"}),
    (("--no_ssh", "--no-ssh"), {"action": "store_true",
                                "help": "with --hostfile and --node_rank: run this node's share only"}),
    (("--launcher",), {"default": None, "help": "how to start several hosts: ssh (default), pdsh, openmpi, "
                                                "slurm (default inside a Slurm allocation)"}),
    (("--ssh_port", "--ssh-port"), {"type": int, "help": "ssh port of the hosts"}),
    (("--force_multi", "--force-multi"),
     {"action": "store_true", "help": "start through the launcher even for one host"}),
    (("--min_elastic_nodes", "--min-elastic-nodes"), {"type": int, "help": "elastic: --nnodes MIN:..."}),
    (("--max_elastic_nodes", "--max-elastic-nodes"), {"type": int, "help": "elastic: --nnodes ...:MAX"}),
    (("--elastic_training", "--elastic-training"),
     {"action": "store_true", "help": "elastic: --nnodes 1:<hosts> unless the range is given"}),
    (("--bind_cores_to_rank", "--bind-cores-to-rank"),
     {"action": "store_true", "help": "OMP_NUM_THREADS = cores / processes (cores are not pinned)"}),
    (("--no_local_rank", "--no-local-rank"),
     {"action": "store_true", "help": "with --deepspeed-compat: do not pass --local_rank=N to the script"}),
    (("--deepspeed-compat", "--deepspeed_compat"),
     {"action": "store_true", "help": "run a script that imports deepspeed on meshspeed, unchanged"}),
]
_NATIVE_OPTIONS = [  # torchrun has these; we read them to plan multi-node runs
    (("--master_addr", "--master-addr"), {"help": "address of node 0"}),
    (("--master_port", "--master-port"), {"type": int, "help": "port on node 0"}),
    (("--node_rank", "--node-rank"), {"type": int, "help": "this node's index"}),
]
_UNSUPPORTED_VALUE = {"--autotuning"}  # the others are plain switches


def _add_options(parser: argparse.ArgumentParser, native: bool) -> None:
    for names, kwargs in _DS_OPTIONS + (_NATIVE_OPTIONS if native else []):
        parser.add_argument(*names, **kwargs)
    for flag in ds_launcher.UNSUPPORTED:
        if flag in _UNSUPPORTED_VALUE:
            parser.add_argument(flag, default=None, help=argparse.SUPPRESS)
        else:
            parser.add_argument(flag, action="store_true", default=None, help=argparse.SUPPRESS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # argparse matches every --word of the command line against our options, the script's
    # arguments included: with abbreviations on, a script's `--deepspeed` would be an
    # "ambiguous" prefix of --deepspeed-compat / --deepspeed_compat.
    parser.allow_abbrev = False
    parser.epilog = ("Every other torchrun option (--nnodes, --rdzv-*, --max-restarts, ...) is "
                     "passed through; see `python -m torch.distributed.run --help`. The deepspeed "
                     "launcher's options are understood; with a hostfile of several hosts every "
                     "host is started (docs/multinode.md).")
    parser.add_argument("--nproc-per-node", "--nproc_per_node", default=None,
                        help="processes per node: an integer, or torchrun's gpu/cpu/auto "
                             "(default: number of CUDA devices, else 1)")
    _add_options(parser, native=True)
    # Everything from the script on belongs to the script, including options that look
    # like ours (-h, --nproc-per-node): REMAINDER stops our parsing at the first
    # positional. Unknown torchrun options before it arrive in args.extra, in order.
    parser.add_argument("script", nargs=argparse.REMAINDER,
                        help="training script (or module, with -m) and its arguments")


def _split(tokens: list[str]) -> tuple[list[str], list[str], argparse.Namespace]:
    """(launcher options, script and its arguments, torchrun's reading of them).

    The first positional word is not always the script (it may be the value of a torchrun
    option, `--max-restarts 3`): torchrun's own parser, which knows each option's arity,
    finds where the script starts."""
    parser = get_args_parser()
    parser.prog, parser.allow_abbrev = "meshspeed run", False
    _add_options(parser, native=False)
    parsed = parser.parse_args(tokens)
    tail = 1 + len(parsed.training_script_args)
    return tokens[:-tail], tokens[-tail:], parsed


def _read_flags(args: argparse.Namespace, launcher_tokens: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Our options wherever they were written (before the first positional word, or after
    a torchrun option's value), and the torchrun tokens left, in order."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--nproc-per-node", "--nproc_per_node", default=None)
    _add_options(parser, native=True)
    late, rest = parser.parse_known_args(launcher_tokens)
    merged = argparse.Namespace(**vars(args))
    for key, value in vars(late).items():
        if value not in (None, False, ""):
            setattr(merged, key, value)
    return merged, rest


def _flags(ns: argparse.Namespace) -> DeepSpeedFlags | None:
    for flag in ds_launcher.UNSUPPORTED:
        if getattr(ns, flag.lstrip("-"), None) not in (None, False):
            raise LaunchError(f"{flag} (a deepspeed launcher option) is not supported: "
                              f"{ds_launcher.UNSUPPORTED[flag]}")
    flags = DeepSpeedFlags(num_gpus=ns.num_gpus, num_nodes=ns.num_nodes, include=ns.include,
                           exclude=ns.exclude, hostfile=ns.hostfile, master_addr=ns.master_addr,
                           master_port=ns.master_port, node_rank=ns.node_rank, no_ssh=ns.no_ssh,
                           launcher=ns.launcher, ssh_port=ns.ssh_port, force_multi=ns.force_multi)
    return None if flags == DeepSpeedFlags() else flags


def _compat_target(target: list[str], rest: list[str], parsed, no_local_rank: bool):
    """Under --deepspeed-compat each rank starts in meshspeed.compat.child, which adds
    DeepSpeed's --local_rank=N and runs the script (or module) as __main__."""
    if parsed.no_python:  # not a Python program: the PYTHONPATH alias is all we can give
        return target, rest
    child = ["-m", "meshspeed.compat.child"] + (["--module"] if parsed.module else [])
    child += ["--no-local-rank"] if no_local_rank else []
    return [*child, *target], [t for t in rest if t not in ("-m", "--module")]


class Launch(NamedTuple):
    argv: list[str]  # for torchrun
    env: dict[str, str]  # set for the launched processes
    compat: bool  # --deepspeed-compat: the deepspeed shim goes first on PYTHONPATH
    remote: RemoteJob | None = None  # instead of argv: a job started on several hosts


def launch_plan(args: argparse.Namespace, *, device_count: int | None = None,
                environ=None) -> Launch:
    """What to start, from `meshspeed run`'s arguments. No processes start here.

    A `RemoteJob` is returned instead of argv when the job is started on several hosts
    (a hostfile or Slurm allocation with several, no --node_rank; or --force_multi)."""
    environ = os.environ if environ is None else environ
    if device_count is None:
        device_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    launcher_tokens, target, parsed = _split([*getattr(args, "extra", []), *args.script])
    ns, rest = _read_flags(args, launcher_tokens)
    # with a hostfile and no maximum, the maximum is its host count (multinode.remote_job)
    deferred = ns.hostfile is not None and ns.max_elastic_nodes is None
    ds_range = None if deferred else elastic.deepspeed_range(ns.min_elastic_nodes, ns.max_elastic_nodes, None)
    if ds_range is not None:
        if elastic.take_option(rest, ("--nnodes",))[0] is not None:
            raise LaunchError("--nnodes and --min_elastic_nodes/--max_elastic_nodes both say the "
                              "number of nodes; give one")
        rest = ["--nnodes", ds_range, *rest]
    flags = _flags(ns)
    if flags is None and slurm_hosts.in_allocation(environ):  # its nodes are the hosts
        flags = DeepSpeedFlags()
    nproc, env, opts = ns.nproc_per_node, {}, []
    if flags is not None:
        hostfile_text = None
        if flags.hostfile is not None:
            try:
                with open(flags.hostfile) as f:
                    hostfile_text = f.read()
            except OSError as err:
                raise LaunchError(f"--hostfile {flags.hostfile}: {err.strerror}") from None
        plan = ds_launcher.plan(flags, device_count=device_count, hostfile_text=hostfile_text,
                                environ=environ)
        if plan.hosts:
            return Launch([], {}, ns.deepspeed_compat,
                          multinode.remote_job(plan, ns, rest, target, parsed, environ))
        if None not in (nproc, plan.nproc_per_node) and str(nproc) != str(plan.nproc_per_node):
            raise LaunchError(f"--nproc-per-node {nproc} and the deepspeed launcher options "
                              f"({plan.nproc_per_node} processes per node) disagree; give one")
        nproc = plan.nproc_per_node or nproc
        env, opts = dict(plan.env), plan.torchrun_options
    if nproc is None:
        nproc = str(device_count) if device_count else "1"
    if ns.bind_cores_to_rank and str(nproc).isdigit():
        # DeepSpeed also pins each rank to its share of the cores (numactl); torchrun does
        # not, so only the thread count follows the split
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(nproc)))
    rest = elastic.local_form(rest, ns.master_addr, ns.master_port)
    if "--rdzv-endpoint" in rest and elastic.is_elastic(rest):  # c10d: torchrun's own go unused
        opts = elastic.take_option(elastic.take_option(opts, ("--master-addr",))[1], ("--master-port",))[1]
    if ns.deepspeed_compat:
        target, rest = _compat_target(target, rest, parsed, ns.no_local_rank)
    return Launch(["--nproc-per-node", str(nproc), *opts, *rest, *target], env, ns.deepspeed_compat)


def torchrun_argv(args: argparse.Namespace) -> list[str]:
    """The argument list for torchrun, in the order the user wrote it (see launch_plan)."""
    return launch_plan(args).argv


def with_rank_entry(argv: list[str]) -> list[str]:
    """torchrun's `argv` with each rank started under rank_entry.py, which records an
    uncaught exception for the report at the end (failures.py). A program that is not
    Python (--no-python) is started as it is."""
    launcher_tokens, target, parsed = _split(argv)
    if parsed.no_python or parsed.run_path:  # --run-path: torchrun runs the script in-process
        return argv
    options = [t for t in launcher_tokens if t not in ("-m", "--module")]
    return [*options, "-m", "meshspeed.launcher.rank_entry", *(["-m"] if parsed.module else []), *target]


def target_problem(argv: list[str]) -> str | None:
    """What is wrong with the script (or -m module) torchrun's `argv` names, in one
    sentence, before any process starts; None when it can be run. A module is looked up
    by its top-level package only: finding a submodule would import its packages here."""
    _, target, parsed = _split(argv)
    name = target[0]
    if parsed.no_python:
        if shutil.which(name) is None:
            return f"the program {name} is not an executable file or on PATH; check the name (--no-python runs it as a program)"
        return None
    if parsed.module:
        if name == "meshspeed.compat.child":  # --deepspeed-compat: its flags, then the user's target
            flags = list(itertools.takewhile(lambda t: t in ("--module", "--no-local-rank"), target[1:]))
            user = target[1 + len(flags):]
            return target_problem(["-m", *user] if "--module" in flags else user) if user else None
        top = name.split(".")[0]
        with contextlib.suppress(ImportError, ValueError):
            if importlib.machinery.PathFinder.find_spec(top, [os.getcwd(), *sys.path]) is not None \
                    or importlib.util.find_spec(top) is not None:
                return None
        return (f"no module named {top!r} (from -m {name}) in the working directory or on "
                f"PYTHONPATH; check the name, or run from the folder that holds it")
    if not os.path.isfile(name):
        what = "is a folder, not a script" if os.path.isdir(name) else "does not exist"
        return f"the script {name} {what} (working directory {os.getcwd()}); check the path"
    return None


@contextlib.contextmanager
def _launch_environment(env: dict[str, str], compat: bool):
    """`env` set for the launched processes (torchrun passes ours on), and with --deepspeed-compat
    a generated `deepspeed` shim first on PYTHONPATH; all undone afterwards."""
    shim_dir = None
    saved = {k: os.environ.get(k) for k in [*env, "PYTHONPATH"]}
    try:
        os.environ.update(env)
        if compat:
            shim_dir = tempfile.mkdtemp(prefix="meshspeed-deepspeed-compat-")
            write_shim(shim_dir)
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [shim_dir, saved["PYTHONPATH"]]))
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if shim_dir is not None:
            shutil.rmtree(shim_dir, ignore_errors=True)


def _autotune_first(args: argparse.Namespace) -> int | None:
    """The deepspeed launcher's `--autotuning tune|run`: tune the script first
    (meshspeed/autotune, docs/autotune.md); `tune` stops there, `run` then launches the
    script with best_config.json in place of its config argument. None: launch now."""
    mode = getattr(args, "autotuning", None)
    if mode is None:
        return None
    args.autotuning = None
    if mode not in ("tune", "run"):
        print(f"meshspeed run: --autotuning takes 'tune' or 'run', got {mode!r}", file=sys.stderr)
        return 2
    script, script_args = args.script[0], args.script[1:]
    nproc = args.nproc_per_node or args.num_gpus or 1
    try:
        out = autotune(script, script_args, nproc=int(nproc))
    except (TuneError, ConfigError, ValueError) as err:
        print(f"meshspeed run --autotuning: {err}", file=sys.stderr)
        return 2
    if out["best"] is None:
        return 1
    if mode == "tune":
        return 0
    best = os.path.join(out["results_dir"], "best_config.json")
    args.script = [script, *substitute(script_args, best, out["best_config"], {})]
    return None


def _torchrun_cause(failure: ChildFailedError) -> tuple[int, str]:
    """(rank, how it ended) of the first rank that failed by itself: torchrun stops the
    others with SIGTERM, and those are not the cause."""
    own = {r: f for r, f in failure.failures.items() if f.signal_name() != "SIGTERM"} or failure.failures
    rank = min(own, key=lambda r: own[r].timestamp)
    return rank, failures.fallback_cause(own[rank].exitcode, own[rank].signal_name() if own[rank].exitcode < 0 else None)


def main(args: argparse.Namespace) -> int:
    if not args.script:
        print("meshspeed run: missing the training script (meshspeed run [options] "
              "script.py [script args])", file=sys.stderr)
        return 2
    tuned = _autotune_first(args)
    if tuned is not None:
        return tuned
    try:
        launch = launch_plan(args)
    except LaunchError as err:
        print(f"meshspeed run: {err}", file=sys.stderr)
        return 2
    if launch.remote is not None:
        return remote_run.run(launch.remote)
    problem = target_problem(launch.argv)
    if problem is not None:
        print(f"meshspeed run: {problem}", file=sys.stderr)
        return 2
    errors_dir = tempfile.mkdtemp(prefix="meshspeed-run-errors-")
    try:
        with _launch_environment({**launch.env, failures.ERRORS_DIR_ENV: errors_dir}, compat=launch.compat):
            torchrun_main(rounds.install(with_rank_entry(launch.argv)))  # Note [the agents number the attempts]
    except ChildFailedError as failure:  # torchrun's own entry point exits 1 here too
        sys.stdout.flush()
        print("\n".join(failures.report(failures.read_records(errors_dir), _torchrun_cause(failure))),
              file=sys.stderr, flush=True)
        return 1
    except SignalException as signal_exc:  # the agent was told to stop; children are down
        return 128 + int(signal_exc.sigval)
    except RendezvousTimeoutError as err:  # meshspeed's own (rounds) has printed its one line
        if not str(err).startswith("meshspeed:"):
            print(f"meshspeed run: the hosts did not meet: {err}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(errors_dir, ignore_errors=True)
    return 0

