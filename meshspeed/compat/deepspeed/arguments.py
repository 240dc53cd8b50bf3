"""`add_config_arguments(parser)`: DeepSpeed's command-line flags, so launch scripts keep
working (`--deepspeed --deepspeed_config ds_config.json`)."""

from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("meshspeed", "meshspeed / DeepSpeed configuration")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable meshspeed (accepted for DeepSpeed compatibility)")
    group.add_argument("--deepspeed_config", "--meshspeed_config", default=None, type=str,
                       help="path to the DeepSpeed-format JSON config")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser
