"""MESHSPEED_COMM_DEBUG=1: catch ranks that issue different collectives, instead of hanging.

Before each group collective, every rank all-gathers a small fingerprint (per-group
call number, op name, shape, dtype, call site) over the same group and raises
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

from meshspeed.comm import sequence

ENV_VAR = "MESHSPEED_COMM_DEBUG"

_call_numbers: dict[int, int] = {}  # id(process group) -> collectives checked so far


class CollectiveMismatchError(RuntimeError):
    """Ranks of one group issued different collectives at the same point."""


def enabled() -> bool:
    return os.environ.get(ENV_VAR, "0") not in ("", "0")


def reset_for_tests() -> None:
    _call_numbers.clear()


def _is_fingerprint(fp: Any) -> bool:
    return isinstance(fp, tuple) and len(fp) == 5


def _describe(fp: Any) -> str:
    if not _is_fingerprint(fp):
        # the peer was not in a debug check: it is inside another collective (often an
        # object collective such as a checkpoint's) whose data landed here
        return f"not at a checked collective (received {str(fp)[:60]!r} instead of a fingerprint)"
    number, op, shape, dtype, site = fp
    return f"collective #{number} {op}(shape={shape}, dtype={dtype}) at {site}"


def check(op: str, group: Any, tensor: torch.Tensor | None, same_shape: bool = True) -> None:
    """Raise CollectiveMismatchError unless every rank of `group` is at the same call."""
    pg = group if group is not None else dist.group.WORLD
    number = _call_numbers.get(id(pg), 0)
    _call_numbers[id(pg)] = number + 1
    shape = tuple(tensor.shape) if tensor is not None and same_shape else None
    dtype = str(tensor.dtype).removeprefix("torch.") if tensor is not None else None
    mine = (number, op, shape, dtype, sequence.format_location(sequence.call_location()))
    # lazy: collectives imports this module (a cycle inside comm)
    from meshspeed.comm.collectives import all_gather_object

    try:
        everyone = all_gather_object(mine, group=pg)
    except Exception as err:
        raise CollectiveMismatchError(
            f"rank {dist.get_rank()}: the collective fingerprint exchange before {op} at "
            f"{mine[4]} (call #{number} on this group) failed ({type(err).__name__}: {err}); "
            "another rank is most likely inside a different collective") from err
    keys = [fp[:4] if _is_fingerprint(fp) else repr(fp) for fp in everyone]
    if all(k == mine[:4] for k in keys):
        return
    common = Counter(keys).most_common(1)[0][0]
    ranks = dist.get_process_group_ranks(pg)
    lines = [f"  rank {rank}: {_describe(fp)}" + ("   <-- differs" if key != common else "")
             for rank, fp, key in zip(ranks, everyone, keys)]
    raise CollectiveMismatchError(
        f"ranks of the group {ranks} issued different collectives "
        f"(seen from rank {dist.get_rank()}):\n" + "\n".join(lines)
    )
