"""MESHSPEED_COMM_DEBUG=1: catch ranks that issue different collectives, instead of hanging.

Before each group collective, every rank all-gathers a small fingerprint (per-group
call number, op name, shape, dtype) over the same group and raises
CollectiveMismatchError on every rank if they differ. This costs one extra object
all-gather per collective, so it is for debugging only. Point-to-point ops are not
checked (only two ranks take part). A rank that calls a collective on a different
group, or none at all, still hangs: the check can only compare ranks that arrive.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

ENV_VAR = "MESHSPEED_COMM_DEBUG"

_call_numbers: dict[int, int] = {}  # id(process group) -> collectives checked so far


class CollectiveMismatchError(RuntimeError):
    """Ranks of one group issued different collectives at the same point."""


def enabled() -> bool:
    return os.environ.get(ENV_VAR, "0") not in ("", "0")


def reset_for_tests() -> None:
    _call_numbers.clear()


def check(op: str, group: Any, tensor: torch.Tensor | None, same_shape: bool = True) -> None:
    """Raise CollectiveMismatchError unless every rank of `group` is at the same call."""
    pg = group if group is not None else dist.group.WORLD
    number = _call_numbers.get(id(pg), 0)
    _call_numbers[id(pg)] = number + 1
    shape = tuple(tensor.shape) if tensor is not None and same_shape else None
    dtype = str(tensor.dtype).removeprefix("torch.") if tensor is not None else None
    mine = (number, op, shape, dtype)
    everyone: list[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(everyone, mine, group=pg)
    if all(fp == mine for fp in everyone):
        return
    common = Counter(everyone).most_common(1)[0][0]
    ranks = dist.get_process_group_ranks(pg)
    lines = [
        f"  rank {rank}: collective #{fp[0]} {fp[1]}(shape={fp[2]}, dtype={fp[3]})"
        + ("   <-- differs" if fp != common else "")
        for rank, fp in zip(ranks, everyone)
    ]
    raise CollectiveMismatchError(
        f"ranks of the group {ranks} issued different collectives "
        f"(seen from rank {dist.get_rank()}):\n" + "\n".join(lines)
    )
