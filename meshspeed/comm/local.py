"""Collectives over a group of one process, done in place without the backend.

Note [a group of one]
At world 1, and on every mesh dimension of size 1, a collective's result is its input: an
all-gather or a reduce-scatter of one rank is a copy, an all-reduce leaves the tensor as it
is. Gloo still runs them on its worker threads, at about a tenth of a memcpy's speed
(200 MB of bf16: 0.14 s for an in-place all-gather and 0.11 s for a reduce-scatter,
against 0.017 s for `copy_`, on the 2-core CI machine), and for ZeRO-3 at world 1 that
is a whole copy of the model per gather and per gradient: 8.7 CPU seconds of a 2B
model's 53 s step, on a machine whose two cores the forward and backward need. So
collectives.py asks `alone(size)` first and, for a group of one, does the copy itself
(none when the output is the input, as when a shard is read into its own range of the
gathered buffer), on the calling thread, and returns a work that is already complete.

The call still goes through collectives._issue: it is recorded in the sequence (so a
debug run compares the same calls), counted (0 bytes: nothing crosses a link) and its
tensors retained, exactly as before. The values are the backend's bit for bit (a sum, an
average, a max ... of one value is that value). Reduce ops other than the plain ones
(a pre-multiplied sum) go to the backend as before.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

_IDENTITY_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.MIN,
                 dist.ReduceOp.PRODUCT, dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR)


def alone(size: int, op: Any = dist.ReduceOp.SUM) -> bool:
    """Whether a collective on a group of `size` processes with reduce op `op` is this
    process's alone."""
    return size == 1 and op in _IDENTITY_OPS


def copy(output: torch.Tensor, input: torch.Tensor, async_op: bool) -> Any:
    """`output` takes `input`'s values (an all-gather or a reduce-scatter of one rank)."""
    if output.dtype != input.dtype or output.numel() != input.numel():
        raise ValueError(f"a collective of one rank needs an output like its input: got "
                         f"{tuple(output.shape)} {output.dtype} for {tuple(input.shape)} {input.dtype}")
    same = output.data_ptr() == input.data_ptr() and output.is_contiguous() and input.is_contiguous()
    if not same:
        output.copy_(input.reshape(output.shape))
    return done(output, async_op)


def done(result: torch.Tensor, async_op: bool) -> Any:
    """What the backend returns for a finished call: None, or a work already complete."""
    if not async_op:
        return None
    future = torch._C.Future([])  # (torch.futures.Future's own Python adds nothing here)
    future.set_result([result])
    return _create_work_from_future(future)
