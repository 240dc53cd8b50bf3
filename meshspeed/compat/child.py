"""Per-rank entry point under `meshspeed run --deepspeed-compat`; torchrun starts

    python -m meshspeed.compat.child [--module] [--no-local-rank] TARGET [ARGS...]

on each rank. DeepSpeed's launcher gives each process what torchrun does not, and scripts
written for it read both: the argument ``--local_rank=<LOCAL_RANK>`` in front of the
script's own arguments (the tutorials declare ``--local_rank`` and some branch on it; a
script that does not accept it is run with --no_local_rank, as under DeepSpeed), and the
environment variables LOCAL_SIZE, CROSS_RANK and CROSS_SIZE. The target then runs as
``python TARGET ARGS`` (or ``python -m TARGET ARGS``) would run it: as __main__, with
sys.argv and sys.path[0] set the same way, with the deepspeed alias already installed.

DeepSpeed prints its log at import: its logger writes INFO and above to stdout, and many
scripts print nothing else (DeepSpeedExamples' pipeline example shows its progress only
through the engine's `steps_per_print` lines). meshspeed as a library gives its logger a
handler of its own at `initialize` only where the program configured none, and on rank 0
only (Note [meshspeed's own handler] in meshspeed/process/speak.py); here, where the
program was written for DeepSpeed, the "meshspeed" logger gets DeepSpeed's set-up instead,
from the start and on every rank: INFO and above to stdout in DeepSpeed's format
(`deepspeed_logging`), unless something configured it already.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys

from meshspeed.compat.alias import install


def child_argv(target: str, args: list[str], environ, local_rank: bool = True) -> list[str]:
    """sys.argv for the target: DeepSpeed's `--local_rank=N` first, then the script's own."""
    extra = [f"--local_rank={environ.get('LOCAL_RANK', '0')}"] if local_rank else []
    return [target, *extra, *args]


def deepspeed_env(environ) -> dict[str, str]:
    """DeepSpeed-launcher variables derived from torchrun's (only those not set already)."""
    derived = {"LOCAL_SIZE": environ.get("LOCAL_WORLD_SIZE"), "CROSS_RANK": environ.get("GROUP_RANK"),
               "CROSS_SIZE": environ.get("GROUP_WORLD_SIZE")}
    return {k: v for k, v in derived.items() if v is not None and k not in environ}


def deepspeed_logging(name: str = "meshspeed") -> logging.Logger:
    """The logger `name` as DeepSpeed sets up its own: INFO and above, one line each, to
    stdout, not passed on to the root logger. A logger that has a handler already, or a
    level of its own, is left as it is."""
    logger = logging.getLogger(name)
    if logger.handlers or logger.level != logging.NOTSET:
        return logger
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] [%(name)s] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return logger


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    module, local_rank = False, True
    # no "--" separator: torchrun's argument parser would drop it
    while argv and argv[0] in ("--module", "--no-local-rank"):
        flag = argv.pop(0)
        module = module or flag == "--module"
        local_rank = local_rank and flag != "--no-local-rank"
    if not argv:
        raise SystemExit("usage: python -m meshspeed.compat.child [--module] [--no-local-rank] TARGET [ARGS...]")
    target, args = argv[0], argv[1:]
    # The shim on PYTHONPATH would install the alias during the script's first deepspeed
    # import, too late to word that statement's own errors (Note [the deepspeed alias]).
    install()
    deepspeed_logging()
    os.environ.update(deepspeed_env(os.environ))
    sys.argv = child_argv(target, args, os.environ, local_rank)
    if module:  # `python -m` keeps the working directory as sys.path[0], as we were started
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:  # `python script.py` puts the script's directory first instead of the working one
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
