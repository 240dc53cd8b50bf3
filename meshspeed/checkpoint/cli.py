"""`meshspeed convert CKPT OUT.safetensors`: consolidate a sharded checkpoint into one file.

`meshspeed convert --to deepspeed CKPT OUT_DIR [--dp N] [--zero-stage S]` writes DeepSpeed
0.19's layout instead (deepspeed_format/write.py)."""

from __future__ import annotations

import argparse
import sys

from meshspeed.checkpoint.consolidate import DTYPES, convert
from meshspeed.checkpoint.deepspeed_format.write import export
from meshspeed.checkpoint.errors import CheckpointError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a save_dir (its `latest` tag is used) or a tag directory, "
                        "of meshspeed or of DeepSpeed (ZeRO 0-3: the fp32 masters, like its zero_to_fp32.py)")
    parser.add_argument("output", help="the .safetensors file to write (with --to deepspeed: the directory)")
    parser.add_argument("--tag", default=None, help="the tag to convert instead of `latest`")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                        help="dtype of the written parameters (default fp32)")
    parser.add_argument("--no-verify", action="store_true",
                        help="skip the SHA-256 check of the checkpoint files")
    parser.add_argument("--to", choices=["safetensors", "deepspeed"], default="safetensors",
                        help="deepspeed: write DeepSpeed 0.19's checkpoint layout into the output directory")
    parser.add_argument("--dp", type=int, default=None,
                        help="with --to deepspeed: the data-parallel size to lay out for (default: the source's)")
    parser.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=None,
                        help="with --to deepspeed: the ZeRO stage to lay out for (default: the source's)")


def _to_deepspeed(args: argparse.Namespace) -> int:

    summary = export(args.checkpoint, args.output, tag=args.tag, dp=args.dp, zero_stage=args.zero_stage,
                     verify=not args.no_verify)
    print(f"wrote DeepSpeed checkpoint {summary['output']} (ZeRO {summary['zero_stage']}, dp "
          f"{summary['dp']}, {summary['dtype']}: {len(summary['files'])} files) from {summary['source']}")
    return 0


def main(args: argparse.Namespace) -> int:
    try:
        if getattr(args, "to", "safetensors") == "deepspeed":
            return _to_deepspeed(args)
        summary = convert(args.checkpoint, args.output, tag=args.tag, dtype=DTYPES[args.dtype],
                          verify=not args.no_verify)
    except CheckpointError as err:
        print(f"meshspeed convert: {err}", file=sys.stderr)
        return 1
    print(f"wrote {summary['tensors']} tensors ({summary['bytes'] / 2**20:.1f} MiB, {args.dtype}) "
          f"from {summary['source']} to {summary['output']}")
    return 0
