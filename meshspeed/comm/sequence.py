"""What this rank issued on each process group: a sequence number per group, and since the
last step agreement a count and an order-sensitive digest of the group collectives, with
the most recent calls kept for reports.

Note [collective digest]
Ranks of a group that issue different collectives do not always hang: two all-reduces of
the same byte size but different dtypes, or of different tensors that happen to be the
same size, pair up and return garbage. The digest folds (op, numel, dtype) of every group
collective into one 61-bit integer, in order, so the step agreement (engine/agreement.py)
compares whole sequences for the price of two more int64 values. Call sites are not in
the digest (rank-dependent code legitimately issues the same collective from different
lines), and neither are point-to-point calls (only two ranks take part) nor numels of
uneven all-to-alls; Python's hash of a tuple of ints is the same in every process.
"""

from __future__ import annotations

import os
import sys
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

RECENT = 64  # calls kept per group for the report of a mismatch
_MASK = (1 << 61) - 1
_OP_CODES = {"all_reduce": 1, "all_gather": 2, "reduce_scatter": 3, "all_to_all": 4, "broadcast": 5}
_HERE = os.path.dirname(os.path.abspath(__file__))
# torch's `Function.apply`, between a differentiable collective and its caller
_AUTOGRAD_APPLY = os.path.join(os.path.dirname(os.path.abspath(torch.autograd.__file__)), "function.py")


@dataclass
class GroupHistory:
    ranks: str  # the group's global ranks, "0,1,2"
    members: tuple[int, ...] = ()  # the same, as numbers
    issued: int = 0  # every call on the group, point-to-point included: the sequence number
    count: int = 0  # group collectives since the last agreement
    digest: int = 0  # Note [collective digest], since the last agreement
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))


_histories: dict[int, GroupHistory] = {}  # id(process group) -> its history


def reset_for_tests() -> None:
    _histories.clear()


def call_location() -> tuple[str, int]:
    """(file, line) of the nearest caller outside meshspeed/comm (and torch's autograd
    Function.apply, for the pairs of differentiable.py). "?" in a backward, which the
    autograd engine calls with no Python caller."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith((_HERE, _AUTOGRAD_APPLY)):
        frame = frame.f_back
    return ("?", 0) if frame is None else (frame.f_code.co_filename, frame.f_lineno)


def format_location(location: tuple[str, int]) -> str:
    path, line = location
    if path == "?":
        return "?"
    try:
        path = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        pass
    return f"{path}:{line}"


_dtype_codes: dict[Any, int] = {}


def _dtype_code(dtype: torch.dtype | None) -> int:
    code = _dtype_codes.get(dtype)
    if code is None:  # crc32, not hash(): a str's hash differs between processes
        code = _dtype_codes[dtype] = zlib.crc32(str(dtype).encode())
    return code


def _pg(group: Any) -> Any:
    """None means the default group: one history for both spellings."""
    return group if group is not None else dist.group.WORLD


def record(op: str, group: Any, tensor: torch.Tensor | None, same_shape: bool) -> tuple[int, tuple[str, int]]:
    """Note one call on `group`; return its sequence number and call location."""
    pg = _pg(group)
    history = _histories.get(id(pg))
    if history is None:
        members = tuple(dist.get_process_group_ranks(pg))
        history = _histories[id(pg)] = GroupHistory(",".join(map(str, members)), members)
    seq = history.issued
    history.issued += 1
    where = call_location()
    code = _OP_CODES.get(op)
    if code is not None:
        numel = tensor.numel() if tensor is not None and same_shape else -1
        dtype = tensor.dtype if tensor is not None else None
        history.count += 1
        history.digest = (history.digest * 1_000_003 + hash((code, numel, _dtype_code(dtype)))) & _MASK
        history.recent.append((seq, op, numel, str(dtype).removeprefix("torch."), where))
    return seq, where


def take_window(group: Any) -> tuple[int, int, list[Any]]:
    """(count, digest, recent calls) of the group collectives since the last call, then
    start a new window."""
    history = _histories.get(id(_pg(group)))
    if history is None:
        return 0, 0, []
    window = (history.count, history.digest, list(history.recent)[-history.count:] if history.count else [])
    history.count, history.digest = 0, 0
    history.recent.clear()
    return window


def members(group: Any) -> tuple[int, ...]:
    """The global ranks of `group` (one a call was recorded on), in group order."""
    history = _histories.get(id(_pg(group)))
    return history.members if history is not None else tuple(dist.get_process_group_ranks(_pg(group)))


def peek(group: Any) -> int:
    """How many calls this rank has issued on `group` so far."""
    history = _histories.get(id(_pg(group)))
    return 0 if history is None else history.issued


def issued_by_group() -> dict[str, int]:
    """{"0,1": calls issued on the group of global ranks 0 and 1, ...}"""
    return {h.ranks: h.issued for h in _histories.values()}
