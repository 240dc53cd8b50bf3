"""`meshspeed autotune [options] script.py [script args]`."""

from __future__ import annotations

import argparse
import sys

from meshspeed.autotune.trial import TuneError
from meshspeed.autotune.tuner import autotune
from meshspeed.config import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.allow_abbrev = False  # the script's own --flags must not match ours by prefix
    parser.add_argument("--config", help="DeepSpeed-format JSON (default: the script's --deepspeed_config)")
    parser.add_argument("--nproc", "--nproc_per_node", "--nproc-per-node", type=int, default=1,
                        help="processes per trial (default 1)")
    parser.add_argument("--top-k", type=int, default=None, help="layouts to measure (default 3)")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps per trial (default autotuning.end_profile_step, 5)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per trial job (default none)")
    parser.add_argument("--results", default=None, help="results folder (default autotuning.results_dir)")
    parser.add_argument("--seq-len", type=int, default=None, help="sequence length, if the probe cannot see it")
    parser.add_argument("--model", default=None, help="model config.json instead of probing the script")
    parser.add_argument("script", nargs=argparse.REMAINDER, help="training script and its arguments")


def main(args: argparse.Namespace) -> int:
    if not args.script:
        print("meshspeed autotune: missing the training script (meshspeed autotune [options] "
              "script.py [script args])", file=sys.stderr)
        return 2
    try:
        out = autotune(args.script[0], args.script[1:], config=args.config, nproc=args.nproc,
                       top_k=args.top_k, steps=args.steps, timeout=args.timeout, results=args.results,
                       seq_len=args.seq_len, model=args.model)
    except (TuneError, ConfigError) as err:
        print(f"meshspeed autotune: {err}", file=sys.stderr)
        return 2
    return 0 if out["best"] is not None else 1
