"""`meshspeed convert CKPT OUT.safetensors`: consolidate a sharded checkpoint into one file."""

from __future__ import annotations

import argparse
import sys

from meshspeed.checkpoint.consolidate import DTYPES, convert
from meshspeed.checkpoint.errors import CheckpointError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a save_dir (its `latest` tag is used) or a tag directory, "
                        "of meshspeed or of DeepSpeed (ZeRO 0-3: the fp32 masters, like its zero_to_fp32.py)")
    parser.add_argument("output", help="the .safetensors file to write")
    parser.add_argument("--tag", default=None, help="the tag to convert instead of `latest`")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                        help="dtype of the written parameters (default fp32)")
    parser.add_argument("--no-verify", action="store_true",
                        help="skip the SHA-256 check of the checkpoint files")


def main(args: argparse.Namespace) -> int:
    try:
        summary = convert(args.checkpoint, args.output, tag=args.tag, dtype=DTYPES[args.dtype],
                          verify=not args.no_verify)
    except CheckpointError as err:
        print(f"meshspeed convert: {err}", file=sys.stderr)
        return 1
    print(f"wrote {summary['tensors']} tensors ({summary['bytes'] / 2**20:.1f} MiB, {args.dtype}) "
          f"from {summary['source']} to {summary['output']}")
    return 0
