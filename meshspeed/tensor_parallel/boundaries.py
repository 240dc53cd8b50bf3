"""Where a plan's sequence-parallel region starts and ends, as module hooks.

The reference GPT enters the sequence-sharded region inside its vocab embedding (a
reduce-scatter) and leaves it inside the vocab head (an all-gather), so it needs nothing
here. Hugging Face models cannot: their mask and rotary code reads the embedding's full
length, and some of their forwards reshape with sizes read from a module's input, so the
plan marks the boundaries on modules instead (Note [HF sequence boundaries] in hf.py):

  sp_input="scatter"  the module's hidden-state input (first positional argument or the
                      `hidden_states` keyword) is replaced by this rank's sequence piece
  sp_input="gather"   ... by the whole sequence, gathered from the pieces
  sp_output="gather"  the module's output (a tensor, or the first item of a tuple) is
                      gathered along the sequence

An input gather is all_gather_sequence (backward reduce-scatters); the column layers
inside the module are sequence-parallel ones told that their input is already gathered
(`ALREADY_GATHERED` as their shared gather), so the module costs one all-gather forward
and one reduce-scatter backward, as Megatron's q/k/v do. An output gather is
gather_from_parallel (backward keeps this rank's piece): what reads it is a plain column
layer (lm_head) whose own backward already sums the input gradient over tp.
Hooks are only installed when sequence parallelism is on.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from meshspeed.comm.differentiable import (
    all_gather_sequence,
    gather_from_parallel,
    scatter_to_parallel,
)

SEQ_DIM = 1  # (B, T, hidden) everywhere a boundary is drawn


class _AlreadyGathered:
    """A column layer's `shared_gather` when a boundary hook gathered its input already:
    hands the input through (the layer then does no input communication of its own)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x


ALREADY_GATHERED = _AlreadyGathered()


def install(module: nn.Module, entry: Any, group: Any, sequence_parallel: bool) -> None:
    """Add the entry's boundary hooks (none without sequence parallelism)."""
    if not sequence_parallel:
        return
    if entry.sp_input is not None:
        op = scatter_to_parallel if entry.sp_input == "scatter" else all_gather_sequence
        module.register_forward_pre_hook(_InputHook(op, group), with_kwargs=True)
    if entry.sp_output == "gather":
        module.register_forward_hook(_OutputHook(group))


class _InputHook:
    def __init__(self, op, group: Any):
        self.op, self.group = op, group

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        if args and torch.is_tensor(args[0]):
            return (self.op(args[0], self.group, SEQ_DIM), *args[1:]), kwargs
        if torch.is_tensor(kwargs.get("hidden_states")):
            kwargs = dict(kwargs, hidden_states=self.op(kwargs["hidden_states"], self.group,
                                                        SEQ_DIM))
            return args, kwargs
        raise TypeError(f"{type(module).__name__}: a sequence-parallel boundary needs the "
                        f"hidden states as the first argument or `hidden_states=`")


class _OutputHook:
    def __init__(self, group: Any):
        self.group = group

    def __call__(self, module: nn.Module, args: tuple, output: Any):
        if torch.is_tensor(output):
            return gather_from_parallel(output, self.group, SEQ_DIM)
        if isinstance(output, tuple) and output and torch.is_tensor(output[0]):
            return (gather_from_parallel(output[0], self.group, SEQ_DIM), *output[1:])
        raise TypeError(f"{type(module).__name__}: cannot gather an output of type "
                        f"{type(output).__name__} along the sequence")
