"""`meshspeed` command line: a thin dispatcher; each subcommand lives with its owner."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, help). Each module defines `add_arguments(parser)` and `main(args)`.
_COMMANDS = {
    "run": ("meshspeed.launcher.launch", "launch a training script on N processes (wraps torchrun)"),
    "env": ("meshspeed.launcher.env_report", "report versions, accelerator, backends, features"),
    "demo": ("meshspeed.demo", "train a small byte-level GPT on the Python stdlib source"),
    "estimate": ("meshspeed.planner.cli", "estimate memory per device for a ZeRO configuration"),
    "plan": ("meshspeed.planner.plan_cli", "rank parallel layouts by predicted step time and memory"),
    "autotune": ("meshspeed.autotune.cli", "measure the best planned layouts on this machine, keep the fastest"),
    "convert": ("meshspeed.checkpoint.cli", "consolidate a sharded checkpoint into one file"),
    "gather-checkpoint": ("meshspeed.checkpoint.gather", "copy a checkpoint saved on node-local disks from every host into one directory"),
    "aio-bench": ("meshspeed.offload.aio_bench", "measure the NVMe swap engine's bandwidth"),
    "pipeline-plot": ("meshspeed.tools.pipeline_plot", "draw a pipeline schedule as executed (Gantt chart PNG)"),
    "compat": ("meshspeed.compat.install", "make `import deepspeed` meshspeed in this environment (install, uninstall, status)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="meshspeed", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in _COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in _COMMANDS:
        parser.print_help() if not argv or argv[0] in ("-h", "--help") else parser.parse_args(argv)
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    name, rest = argv[0], argv[1:]
    module = importlib.import_module(_COMMANDS[name][0])
    cmd_parser = argparse.ArgumentParser(prog=f"meshspeed {name}", description=_COMMANDS[name][1])
    module.add_arguments(cmd_parser)
    if getattr(module, "PASSTHROUGH", False):  # `run` forwards unknown args to torchrun
        args, extra = cmd_parser.parse_known_args(rest)
        args.extra = extra
    else:
        args = cmd_parser.parse_args(rest)
    return int(module.main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
