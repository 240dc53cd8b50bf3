"""DeepSpeed's `deepspeed.utils.zero_to_fp32` functions, reading meshspeed checkpoints.

    from meshspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    state_dict = get_fp32_state_dict_from_zero_checkpoint(save_dir)   # tag: `latest`
    model.load_state_dict(state_dict)

A checkpoint written by `engine.save_checkpoint` at any ZeRO stage (and any data-parallel
and tensor-parallel size: the tensors come back whole, in their logical shapes) holds each parameter's fp32 master as ranges spread over the ranks' files;
`meshspeed.checkpoint.consolidate` assembles them with no process group. The functions
here are DeepSpeed's names and arguments over it. Tensors come back in fp32 (masters;
floating buffers cast to fp32, integer buffers as saved); tied parameters appear under
every name. `python -m meshspeed.utils.zero_to_fp32 save_dir out.safetensors` (or
`meshspeed convert`) does the same from the command line.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from safetensors.torch import save_file
from torch import nn

from meshspeed.checkpoint.atomic import write_with
from meshspeed.checkpoint.consolidate import consolidate, convert
from meshspeed.checkpoint.metadata import read_meta
from meshspeed.checkpoint.paths import resolve

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
]

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


def _frozen_names(checkpoint_dir, tag) -> set[str]:
    meta = read_meta(resolve(checkpoint_dir, tag))
    frozen = {name for name, p in meta["params"].items() if not p["requires_grad"]}
    return frozen | {alias for alias, name in meta["aliases"].items() if name in frozen}


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """The full fp32 state dict of the checkpoint `checkpoint_dir/<tag>` (tag None: the tag
    named in `checkpoint_dir/latest`), on the CPU.

    `lazy_mode` is accepted for DeepSpeed's signature; the tensors are always materialised
    (use `convert_zero_checkpoint_to_fp32_state_dict` with a .safetensors file to stream
    a model too large to hold twice)."""
    del lazy_mode
    state = consolidate(checkpoint_dir, tag)
    if exclude_frozen_parameters:
        for name in _frozen_names(checkpoint_dir, tag):
            state.pop(name, None)
    return state


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_file, tag: str | None = None,
                                               *, exclude_frozen_parameters: bool = False,
                                               safe_serialization: bool = False,
                                               max_shard_size=None) -> str:
    """Write the fp32 state dict to `output_file`; returns the path written.

    A path ending in .safetensors is written as safetensors, streamed one parameter at a
    time; one ending in .bin/.pt/.pth with `torch.save`. Any other path is a directory, as
    in DeepSpeed >= 0.16: `model.safetensors` (safe_serialization) or `pytorch_model.bin`
    is written inside it. `max_shard_size` is accepted and ignored: the output is one file.
    """
    del max_shard_size
    path = os.fspath(output_file)
    if not path.endswith((".safetensors", *_PICKLE_SUFFIXES)):
        os.makedirs(path, exist_ok=True)
        path = os.path.join(path, "model.safetensors" if safe_serialization else "pytorch_model.bin")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if path.endswith(".safetensors") and not exclude_frozen_parameters:
        convert(checkpoint_dir, path, tag=tag)
        return path
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    # every rank of a job may call this with one path (DeepSpeed's tests do): each writes its
    # own temporary file and renames it, so a reader never sees a half-written one
    if path.endswith(".safetensors"):
        write_with(path, lambda tmp: save_file(_untied(state), tmp, metadata={"format": "pt"}))
    else:
        write_with(path, lambda tmp: torch.save(state, tmp))
    return path


def _untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory: give each repeated tensor its own copy."""
    seen: set[int] = set()
    out = {}
    for name, t in state.items():
        out[name] = t.clone() if id(t) in seen else t
        seen.add(id(t))
    return out


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir,
                                         tag: str | None = None) -> nn.Module:
    """Move `model` to the CPU and load the checkpoint's fp32 weights into it (non-strict,
    as DeepSpeed does); returns the model. Build a fresh engine to train it further."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshspeed.utils.zero_to_fp32",
                                     description="write a checkpoint's fp32 weights to one file")
    parser.add_argument("checkpoint_dir", help="the save_dir given to save_checkpoint (or a tag folder)")
    parser.add_argument("output", help="a .safetensors / .bin file, or a directory")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: `latest`)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    parser.add_argument("--safe_serialization", action="store_true",
                        help="with a directory output: model.safetensors instead of pytorch_model.bin")
    args = parser.parse_args(argv)
    path = convert_zero_checkpoint_to_fp32_state_dict(
        args.checkpoint_dir, args.output, tag=args.tag,
        exclude_frozen_parameters=args.exclude_frozen_parameters,
        safe_serialization=args.safe_serialization)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
