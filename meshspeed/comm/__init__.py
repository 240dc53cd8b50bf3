"""Communication: the only package in meshspeed that calls torch.distributed collectives.

    from meshspeed import comm
    comm.all_reduce(grad, group=dp_group, op="avg")
    with comm.CommCounter() as counter:
        ...
    counter.summary()["all_reduce"]["bytes"]

collectives.py  free functions over an explicit process group
counter.py      the single counting hook and CommCounter (Note [ring bytes])
logger.py       CommLogger for the `comms_logger` config block
debug.py        MESHSPEED_COMM_DEBUG=1 cross-rank check of collective order
sequence.py     per-group sequence numbers and the digest the step agreement compares
rollcall.py     who is where, through the store, when a collective fails
blocked.py      BlockedTimer: seconds blocked in communication (exposed, not overlapped)
along.py        gather / reduce-scatter / split / all-to-all along any dimension
compressed.py   1-bit error-compensated all-reduce (1-bit Adam's momentum)
differentiable.py  forward/backward pairs for tensor, sequence and expert parallelism
"""

from torch.distributed import ReduceOp  # DeepSpeed scripts write deepspeed.comm.ReduceOp.SUM

from meshspeed.comm.blocked import BlockedTimer
from meshspeed.comm.collectives import (
    CommError,
    CommTimeoutError,
    PeerLostError,
    all_gather,
    all_gather_into_tensor,
    all_gather_object,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    broadcast_object,
    get_rank,
    get_world_size,
    irecv,
    is_initialized,
    isend,
    recv,
    reduce_scatter_tensor,
    send,
    set_timeout,
)
from meshspeed.comm.counter import COMM_OPS, CommCounter, ring_bytes
from meshspeed.comm.debug import CollectiveMismatchError
from meshspeed.comm.differentiable import (
    all_gather_sequence,
    copy_to_parallel,
    gather_from_parallel,
    reduce_from_parallel,
    reduce_scatter_sequence,
    scatter_to_parallel,
)
from meshspeed.comm.logger import CommLogger

__all__ = [
    "COMM_OPS",
    "BlockedTimer",
    "CollectiveMismatchError",
    "CommCounter",
    "CommError",
    "CommLogger",
    "CommTimeoutError",
    "PeerLostError",
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_sequence",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object",
    "copy_to_parallel",
    "gather_from_parallel",
    "get_rank",
    "get_world_size",
    "irecv",
    "is_initialized",
    "isend",
    "recv",
    "reduce_from_parallel",
    "reduce_scatter_sequence",
    "reduce_scatter_tensor",
    "ring_bytes",
    "scatter_to_parallel",
    "send",
    "set_timeout",
]

