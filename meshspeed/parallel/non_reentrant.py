"""`non_reentrant_checkpoint(function, *args)`: activation checkpointing without a reentrant
backward, for the pipeline's `pipeline.use_reentrant: false`.

meshspeed's `checkpoint` (activation_checkpoint.py) is an autograd Function whose backward
recomputes the block and runs a backward of its own inside the outer one (reentrant). This
is torch's non-reentrant checkpoint instead: the forward runs under saved-tensor hooks that
drop what the graph would keep and recompute it when backward first asks for it. So it
needs no argument that requires grad, works with `torch.autograd.grad`, and the graph
through the block is one graph; what it keeps of the arguments is what autograd keeps
(references to them), so it cannot slice or offload them.

Note [what the non-reentrant checkpoint keeps of the policy]
The recompute sees the generators as the forward did: host and CUDA states by torch's
`preserve_rng_state`, and the RNG tracker's named states (tensor-parallel dropout) recorded
at the forward and put back for the recompute, then restored, through `context_fn`.
`partition_activations` and `cpu_checkpointing` act on the tensors the reentrant Function
keeps, which this one never holds: under either setting this is an error, not a silent
full-size copy on the device. Use the reentrant checkpoint (`use_reentrant: true`) for them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from meshspeed.parallel import rng_tracker
from meshspeed.parallel.activation_checkpoint import current_policy

__all__ = ["NonReentrantCheckpointError", "non_reentrant_checkpoint"]


class NonReentrantCheckpointError(ValueError):
    """The configured activation checkpointing needs the reentrant checkpoint."""


def non_reentrant_checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)` with its activations recomputed in backward, by torch's
    non-reentrant checkpoint (module docstring). Under `torch.no_grad()` a plain call."""
    if not callable(function):
        raise TypeError(f"non_reentrant_checkpoint(function, *args): function must be callable, got "
                        f"{type(function).__name__}")
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    policy = current_policy()
    if policy.partition or policy.cpu:
        setting = "partition_activations" if policy.partition else "cpu_checkpointing"
        raise NonReentrantCheckpointError(
            f"activation_checkpointing.{setting} needs the reentrant checkpoint, which keeps the "
            "inputs it slices or offloads; set \"pipeline\": {\"use_reentrant\": true} or turn "
            f"{setting} off (Note [what the non-reentrant checkpoint keeps of the policy])")
    states: list[dict] = []
    return _torch_checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True,
                             context_fn=lambda: (_record(states), _replay(states)), **kwargs)


@contextlib.contextmanager
def _record(states: list[dict]) -> Iterator[None]:
    states.append(rng_tracker.get_cuda_rng_tracker().get_states())
    yield


@contextlib.contextmanager
def _replay(states: list[dict]) -> Iterator[None]:
    tracker = rng_tracker.get_cuda_rng_tracker()
    now = tracker.get_states()
    tracker.set_states(states[0])
    try:
        yield
    finally:
        tracker.set_states(now)
