"""`meshspeed run`: start a training script on N processes per node, through torchrun.

This is a front over ``torch.distributed.run`` (torchrun), not a launcher of our own:
torchrun already does rendezvous, restarts, per-rank logs and multi-node. We add one
default -- ``--nproc-per-node`` is the number of CUDA devices, or 1 without CUDA -- and
forward every other argument unchanged, so any torchrun option works here::

    meshspeed run --nproc-per-node 2 train.py --lr 3e-4
    meshspeed run --nnodes 2 --node-rank 0 --master-addr node0 train.py
"""

from __future__ import annotations

import argparse
import sys

import torch

PASSTHROUGH = True  # meshspeed.cli hands options it does not know to us as `args.extra`


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("Every other torchrun option (--nnodes, --node-rank, --master-addr, "
                     "--master-port, --rdzv-*, --max-restarts, ...) is passed through; see "
                     "`python -m torch.distributed.run --help`.")
    parser.add_argument("--nproc-per-node", "--nproc_per_node", default=None,
                        help="processes per node: an integer, or torchrun's gpu/cpu/auto "
                             "(default: number of CUDA devices, else 1)")
    # Everything from the script on belongs to the script, including options that look
    # like ours (-h, --nproc-per-node): REMAINDER stops our parsing at the first
    # positional. Unknown torchrun options before it arrive in args.extra, in order.
    parser.add_argument("script", nargs=argparse.REMAINDER,
                        help="training script (or module, with -m) and its arguments")


def torchrun_argv(args: argparse.Namespace) -> list[str]:
    """The argument list for torchrun, in the order the user wrote it.

    ``args.extra`` holds the unknown options that came before the script; ``args.script``
    starts at the first positional word, which is either the script or the value of an
    unknown option (``--master-port 1234``) -- concatenating the two restores the original
    order either way.
    """
    nproc = args.nproc_per_node
    if nproc is None:
        nproc = str(torch.cuda.device_count()) if torch.cuda.is_available() else "1"
    return ["--nproc-per-node", str(nproc), *getattr(args, "extra", []), *args.script]


def main(args: argparse.Namespace) -> int:
    if not args.script:
        print("meshspeed run: missing the training script (meshspeed run [options] "
              "script.py [script args])", file=sys.stderr)
        return 2
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(torchrun_argv(args))
    except ChildFailedError as failure:  # torchrun's own entry point exits 1 here too
        print(failure, file=sys.stderr)
        return 1
    except SignalException as signal_exc:  # the agent was told to stop; children are down
        return 128 + int(signal_exc.sigval)
    return 0
