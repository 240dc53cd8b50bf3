"""Collectives as free functions over an explicit process group.

The only module in meshspeed that calls torch.distributed collectives. Conventions:

* `group=None` means the default (WORLD) group; library code passes its group.
* Peer ranks (`src`, `dst`) are ranks *within `group`*, the numbering `get_rank(group)`
  returns, not global ranks. They coincide for the default group.
* `op` is "sum", "avg", "max", "min", "prod" or a torch ReduceOp. Gloo has no AVG, so
  "avg" is a sum followed by division by the group size (in place, on the result), done
  on `wait()` for async calls; backends with a native AVG (NCCL) use it.
* With `async_op=True` a call returns a work handle with `wait()`; otherwise None.
* Every call reports itself once to `counter.record` (bytes per Note [ring bytes] in
  counter.py, host wall time of the call or, for async calls, of the launch).
"""

from __future__ import annotations

import datetime
import pickle
import re
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from meshspeed.comm import blocked, counter, debug, local, registry, rollcall, sequence
from meshspeed.comm.counter import ring_bytes

ReduceOpLike = str | dist.ReduceOp

# torch 2.13 renamed the tensor-in/tensor-out forms; keep working on older releases.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_NAMED_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "prod": dist.ReduceOp.PRODUCT,
}


# -- group queries ------------------------------------------------------------------------------


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group: Any = None) -> int:
    """This process's rank within `group` (-1 if it is not a member)."""
    return dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group)


def set_timeout(seconds: float, group: Any = None) -> None:
    """How long a collective on `group` (default: every group made from the default one
    afterwards, and the default group itself) may wait before it fails with
    CommTimeoutError. Gloo and NCCL enforce it; torch exposes the setter privately."""
    distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=float(seconds)), group)


def barrier(group: Any = None) -> None:
    dist.barrier(group=group)


# -- the one place every collective goes through -------------------------------------------------


class CommError(RuntimeError):
    """A collective failed: names the collective, its group, this rank's sequence number on
    the group and the call site."""


class CommTimeoutError(CommError):
    """A collective did not complete within the process group's timeout (`comms_timeout`)."""


class PeerLostError(CommError):
    """A peer of the group closed its connection (it died or exited) during a collective."""


def _timeout_error(op: str, group: Any, seq: int, site: str, err: Exception) -> CommError | None:
    """The backend's error as a CommError naming the collective, or None if it is another
    kind of failure."""
    text = str(err)
    first = text.splitlines()[0][:200] if text else type(err).__name__
    lowered = text.lower()
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    where = f"rank {dist.get_rank()}: {op} #{seq} on group {ranks} (called at {site})"
    if "timed out" in lowered or "timeout" in lowered:
        kind, says = CommTimeoutError, (
            f"{where} did not complete within the timeout: another rank of the group is not in "
            f"this collective (stuck, or issued a different sequence of collectives"
            f"{'' if debug.enabled() else '; rerun with MESHSPEED_COMM_DEBUG=1 to compare them'}).")
    elif "connection closed by peer" in lowered or "connection reset by peer" in lowered:
        peer = re.search(r"\[([0-9a-fA-F.:]+)\]:(\d+)", text)
        who = f" ({registry.describe_address(peer.group(1), peer.group(2))})" if peer else ""
        kind, says = PeerLostError, (
            f"{where} failed: a peer{who} closed its connection; it died or exited, see its "
            f"own error above.")
    else:
        return None
    roll = rollcall.report(op, ranks, seq, site)  # Note [roll call]
    # the roll call before the backend's own words: a launcher that keeps one line of the
    # cause (meshspeed run: launcher/failures.one_line) keeps who is missing
    return kind(says + ("\n" + roll if roll else "") + f"\n{type(err).__name__}: {first}")


class _TimedWork:
    """A work handle whose wait() turns a backend timeout into CommTimeoutError."""

    def __init__(self, work: Any, op: str, group: Any, seq: int, where: tuple[str, int]) -> None:
        self._work, self._op, self._group, self._seq, self._where = work, op, group, seq, where
        _unwaited.add(self)

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        _unwaited.discard(self)
        start = time.perf_counter() if blocked.active() else None
        try:
            return self._work.wait(*args, **kwargs)
        except RuntimeError as err:
            named = _timeout_error(self._op, self._group, self._seq,
                                   sequence.format_location(self._where), err)
            if named is None:
                raise
            raise named from err
        finally:
            if start is not None:
                blocked.add(self._op, time.perf_counter() - start)

    def is_completed(self) -> bool:
        return self._work.is_completed()


# Note [the last collectives' tensors outlive their work]
# Gloo runs a collective on a worker thread that drops its reference to the work, and so to
# the work's tensors, a moment after it wakes the caller. If the caller has already dropped
# its own references, the worker's is the last one and the worker frees a Python-owned
# tensor, which needs the GIL; at interpreter exit the GIL is gone and the thread is torn
# down mid-destructor, which aborts the process ("terminate called without an active
# exception", issue 9 case 7: one short run in ~40 under load, seen after the last
# checkpoint agreement). Keeping the tensors of the last few collectives referenced from
# Python until later ones replace them moves every such free to the calling thread.
_retained: deque = deque(maxlen=4)
_unwaited: weakref.WeakSet = weakref.WeakSet()  # async works nobody has waited for yet


def finish_outstanding() -> int:
    """Wait for every asynchronous collective still running (before the process group is
    torn down: a work that completes during interpreter exit aborts the process, Note [the
    last collectives' tensors outlive their work]); returns how many there were. Called by
    meshspeed's exit handler after the ranks' last barrier, so every peer has issued its
    side; a failure here is left to the caller."""
    pending = list(_unwaited)
    for work in pending:
        work.wait()
    return len(pending)


def _issue(
    op: str,
    nbytes: int,
    group: Any,
    launch: Callable[[], Any],
    tensor: torch.Tensor | None,
    same_shape: bool = True,
    retain: Any = None,
    counted: bool = True,
) -> Any:
    """Run `launch()` (the torch.distributed call), reporting it to the counting hook; a
    timeout, now or at the returned work's wait(), is raised as CommTimeoutError.
    `retain`: the call's other tensors (Note [the last collectives' tensors outlive their
    work]); `counted=False` keeps metadata exchanges out of the counters and the digest."""
    _retained.append((tensor, retain))
    if not counted:  # named after the calls before it, for reports
        return _launch(f"object {op}", group, launch, sequence.peek(group), sequence.call_location())
    if debug.enabled() and op not in ("send", "recv"):
        debug.check(op, group, tensor, same_shape)
    seq, where = sequence.record(op, group, tensor, same_shape)
    start = time.perf_counter()
    work = _launch(op, group, launch, seq, where)
    if counter.has_sinks():
        counter.record(op, nbytes, time.perf_counter() - start, sequence.members(group))
    if work is None and blocked.active():  # a synchronous call blocks for all of it
        blocked.add(op, time.perf_counter() - start)
    return work


def _launch(op: str, group: Any, launch: Callable[[], Any], seq: int, where: tuple[str, int]) -> Any:
    try:
        work = launch()
    except RuntimeError as err:
        named = _timeout_error(op, group, seq, sequence.format_location(where), err)
        if named is None:
            raise
        raise named from err
    return work if work is None else _TimedWork(work, op, group, seq, where)


class _ThenWork:
    """A work handle that runs `then()` once after the underlying work completes."""

    def __init__(self, work: Any, then: Callable[[], None]) -> None:
        self._work = work
        self._then: Callable[[], None] | None = then

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        done = self._work.wait(*args, **kwargs)
        if self._then is not None:
            then, self._then = self._then, None
            then()
        return done

    def is_completed(self) -> bool:
        return self._work.is_completed()


def _reduce_op(op: ReduceOpLike, group: Any, result: torch.Tensor) -> tuple[Any, bool]:
    """(the ReduceOp to pass to torch, whether to divide `result` by the group size after)."""
    if isinstance(op, str):
        try:
            op = _NAMED_OPS[op.lower()]
        except KeyError:
            raise ValueError(
                f"unknown reduce op {op!r}; expected one of {sorted(_NAMED_OPS)} or a ReduceOp"
            ) from None
    if op == dist.ReduceOp.AVG and dist.get_backend(group) == "gloo":
        if not result.is_floating_point() and not result.is_complex():
            raise TypeError(f"op='avg' needs a floating-point tensor, got {result.dtype}")
        return dist.ReduceOp.SUM, True
    return op, False


def _average_after(work: Any, result: torch.Tensor, n: int, divide: bool) -> Any:
    """Divide `result` by `n` (the group's size) after `work`, for "avg" on gloo."""
    if not divide or n == 1:  # x / 1 is x
        return work
    if work is None:
        result.div_(n)
        return None
    return _ThenWork(work, lambda: result.div_(n))


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _global(group: Any, group_rank: int) -> int:
    """The global rank of `group_rank` in `group` (what torch.distributed takes)."""
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


# -- collectives --------------------------------------------------------------------------------


def all_reduce(
    tensor: torch.Tensor, group: Any = None, op: ReduceOpLike = "sum", async_op: bool = False
) -> Any:
    """Reduce `tensor` in place across `group`. DeepSpeed's positional order
    `all_reduce(tensor, op, group)` is understood too (an op where the group goes)."""
    if isinstance(group, (str, dist.ReduceOp)):
        group, op = (None if isinstance(op, (str, dist.ReduceOp)) else op), group
    torch_op, divide = _reduce_op(op, group, tensor)
    n = get_world_size(group)
    work = _issue(
        "all_reduce",
        ring_bytes("all_reduce", _nbytes(tensor), n),
        group,
        (lambda: local.done(tensor, async_op)) if local.alone(n, torch_op) else  # Note [a group of one]
        (lambda: dist.all_reduce(tensor, op=torch_op, group=group, async_op=async_op)),
        tensor,
    )
    return _average_after(work, tensor, n, divide)


def all_gather_into_tensor(
    output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False
) -> Any:
    """Concatenate every rank's `input` along dim 0 into `output` (N times larger)."""
    n = get_world_size(group)
    return _issue(
        "all_gather",
        ring_bytes("all_gather", _nbytes(output), n),
        group,
        (lambda: local.copy(output, input, async_op)) if local.alone(n) else  # Note [a group of one]
        (lambda: _all_gather_single(output, input, group=group, async_op=async_op)),
        input,
        retain=output,
    )


def all_gather(
    tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False
) -> Any:
    """Fill `tensor_list[r]` with rank r's `tensor`."""
    total = sum(_nbytes(t) for t in tensor_list)
    nbytes = ring_bytes("all_gather", total, get_world_size(group))
    return _issue(
        "all_gather",
        nbytes,
        group,
        lambda: dist.all_gather(tensor_list, tensor, group=group, async_op=async_op),
        tensor,
        retain=tensor_list,
    )


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Any = None,
    op: ReduceOpLike = "sum",
    async_op: bool = False,
) -> Any:
    """Reduce `input` across ranks; rank r keeps the r-th of N equal dim-0 chunks in `output`."""
    torch_op, divide = _reduce_op(op, group, output)
    n = get_world_size(group)
    work = _issue(
        "reduce_scatter",
        ring_bytes("reduce_scatter", _nbytes(input), n),
        group,
        (lambda: local.copy(output, input, async_op)) if local.alone(n, torch_op) else  # Note [a group of one]
        (lambda: _reduce_scatter_single(output, input, op=torch_op, group=group, async_op=async_op)),
        input,
        retain=output,
    )
    return _average_after(work, output, n, divide)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Any = None,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    async_op: bool = False,
) -> Any:
    """Rank r sends dim-0 chunk j of `input` to rank j and receives chunk r of every rank.

    Chunks are equal unless split sizes (rows per rank) are given.
    """
    n = get_world_size(group)
    if input_split_sizes is None:
        nbytes = ring_bytes("all_to_all", _nbytes(input), n)
    else:  # exact: everything except the rows this rank sends to itself
        row_bytes = _nbytes(input[0]) if input.dim() and input.shape[0] else 0
        nbytes = _nbytes(input) - input_split_sizes[get_rank(group)] * row_bytes
    uneven = input_split_sizes is not None or output_split_sizes is not None
    return _issue(
        "all_to_all",
        nbytes,
        group,
        lambda: dist.all_to_all_single(
            output,
            input,
            output_split_sizes=None if output_split_sizes is None else list(output_split_sizes),
            input_split_sizes=None if input_split_sizes is None else list(input_split_sizes),
            group=group,
            async_op=async_op,
        ),
        input,
        same_shape=not uneven,
        retain=output,
    )


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    """Copy `tensor` of rank `src` (a rank within `group`) to every rank of `group`."""
    nbytes = ring_bytes("broadcast", _nbytes(tensor), get_world_size(group))
    return _issue(
        "broadcast",
        nbytes,
        group,
        lambda: dist.broadcast(tensor, _global(group, src), group=group, async_op=async_op),
        tensor,
    )


# -- point to point ------------------------------------------------------------------------------


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> None:
    """Blocking send to `dst`, a rank within `group`. `tag` (>= 0) pairs it with the
    receive of the same tag on gloo; NCCL ignores tags and pairs in order."""
    _issue(
        "send",
        _nbytes(tensor),
        group,
        lambda: dist.send(tensor, _global(group, dst), group, tag),
        tensor,
    )


def recv(tensor: torch.Tensor, src: int, group: Any = None, tag: int = 0) -> None:
    """Blocking receive from `src`, a rank within `group`, into `tensor` (`tag`: see send)."""
    _issue(
        "recv",
        _nbytes(tensor),
        group,
        lambda: dist.recv(tensor, _global(group, src), group, tag),
        tensor,
    )


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> Any:
    """Non-blocking send to `dst` (a rank within `group`); returns a work handle (`tag`:
    see send)."""
    return _issue(
        "send",
        _nbytes(tensor),
        group,
        lambda: dist.isend(tensor, _global(group, dst), group, tag),
        tensor,
    )


def irecv(tensor: torch.Tensor, src: int, group: Any = None, tag: int = 0) -> Any:
    """Non-blocking receive from `src` (a rank within `group`); returns a work handle
    (`tag`: see send)."""
    return _issue(
        "recv",
        _nbytes(tensor),
        group,
        lambda: dist.irecv(tensor, _global(group, src), group, tag),
        tensor,
    )


# -- object collectives (small metadata; not counted) -------------------------------------------
# Written here rather than taken from torch.distributed so that their temporary tensors go
# through _issue too (Note [the last collectives' tensors outlive their work]). Objects
# travel pickled between the ranks of one job.


def _object_device(group: Any) -> torch.device:
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _exchange(op: str, group: Any, out: torch.Tensor, inp: torch.Tensor, src: int | None = None) -> None:
    if op == "broadcast":
        _issue(op, 0, group, lambda: dist.broadcast(out, _global(group, src), group=group), out,
               counted=False)
    else:
        _issue(op, 0, group, lambda: _all_gather_single(out, inp, group=group), inp, retain=out,
               counted=False)


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """[obj of rank 0, obj of rank 1, ...] over `group`; objects travel pickled."""
    device, n = _object_device(group), get_world_size(group)
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    sizes = torch.empty(n, dtype=torch.int64, device=device)
    _exchange("all_gather", group, sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device))
    longest = int(sizes.max())
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    everything = torch.empty(n * longest, dtype=torch.uint8, device=device)
    _exchange("all_gather", group, everything, padded)
    raw = everything.cpu().numpy().tobytes()
    return [pickle.loads(raw[r * longest : r * longest + int(sizes[r])]) for r in range(n)]  # peers of this job


def broadcast_object(obj: Any, src: int, group: Any = None) -> Any:
    """Return rank `src`'s `obj` (src is a rank within `group`) on every rank."""
    device = _object_device(group)
    size = torch.zeros(1, dtype=torch.int64, device=device)
    data = None
    if get_rank(group) == src:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
        size[0] = data.numel()
    _exchange("broadcast", group, size, size, src)
    if data is None:
        data = torch.empty(int(size), dtype=torch.uint8, device=device)
    _exchange("broadcast", group, data, data, src)
    if get_rank(group) == src:
        return obj
    return pickle.loads(data.cpu().numpy().tobytes())  # peers of this job
