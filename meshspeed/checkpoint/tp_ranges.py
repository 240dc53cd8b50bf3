"""Flat element ranges of tensor-parallel pieces, mapped to the logical (whole) parameter.

Pure index arithmetic, no processes and no files: reshard.py builds its read plans from
it, snapshot.py uses it to leave padding out of the saved tensors.

Note [tensor-parallel ranges]
Under tensor parallelism a rank's parameter is a piece of the logical one (a `TPShard`:
pieces along one dimension `dim`, maybe a padded tail), and ZeRO then shards that LOCAL
tensor: a saved or loaded range is a flat range [s, e) of some rank's local tensor. View
a local tensor as (outer, local_size, inner), where outer is the product of the sizes
before `dim` and inner of those after it. For one outer index and one piece
(local_start, logical_start, length), the local elements
    (o * local_size + local_start) * inner  ...  + length * inner
are contiguous, and so are their places in the logical tensor, starting at
    (o * n + logical_start) * inner          (n: the logical size along dim).
So a flat local range is a list of *runs* `(local, logical, length)`, contiguous in both
flattenings; padding rows belong to no run. Resharding (Note [resharding is range
intersection] in reshard.py) is then the intersection of two run lists in logical
coordinates: the runs the loading rank needs and the runs a saved range holds. A
parameter tensor parallelism did not split is one run with local == logical.

A saved range holds only the elements of its runs, in local order: padding is never
written, so `file_offsets` turns a run's local position into its position in the file.
"""

from __future__ import annotations

import bisect
import math

from meshspeed.topology.shards import TPShard

Run = tuple[int, int, int]  # (local flat start, logical flat start, length)
Copy = tuple[int, int, int]  # (destination offset, source offset, length)


def logical_shape(s) -> tuple[int, ...]:
    """The whole parameter's shape of an OwnedSlice (its own shape when not split)."""
    return tuple(s.tp.logical_shape) if s.tp is not None else tuple(s.shape)


def runs(shard: TPShard | None, start: int, end: int) -> list[Run]:
    """The local flat range [start, end) as runs contiguous locally and logically, in local
    order (Note [tensor-parallel ranges]); padding elements are in no run. With no shard
    (a parameter not split) the range is one run onto the same logical elements."""
    if end <= start:
        return []
    if shard is None:
        return [(start, start, end - start)]
    shape = shard.logical_shape
    inner = math.prod(shape[shard.dim + 1:])
    n, block = shape[shard.dim], shard.local_size * inner  # block: one outer index, locally
    pieces = sorted(shard.pieces)
    out: list[Run] = []
    if block == 0:
        return out
    for o in range(start // block, (end - 1) // block + 1):
        for local, logical, length in pieces:
            a = o * block + local * inner
            b = a + length * inner
            lo, hi = max(a, start), min(b, end)
            if lo < hi:
                out.append((lo, (o * n + logical) * inner + lo - a, hi - lo))
    return out


def held(run_list: list[Run]) -> int:
    """Elements the runs hold (the range's non-padding elements)."""
    return sum(length for _, _, length in run_list)


def file_offsets(run_list: list[Run]) -> list[int]:
    """Where each run starts in a saved tensor holding the runs back to back."""
    out, at = [], 0
    for _, _, length in run_list:
        out.append(at)
        at += length
    return out


class Wanted:
    """The runs a rank needs (local starts relative to its buffer), sorted by logical start
    once, to intersect with many saved ranges."""

    def __init__(self, dest: list[Run]):
        self.runs = sorted(dest, key=lambda r: r[1])
        self.starts = [r[1] for r in self.runs]
        self.numel = held(dest)


def intersect(wanted: Wanted, src: list[Run], src_offsets: list[int]) -> list[Copy]:
    """Copies that bring the elements `src` holds into the places `wanted` needs them.

    src: the runs a saved range holds, with the file offset of each. Returns (offset in the
    destination buffer, offset in the saved tensor, length), in saved-tensor order."""
    by_logical, starts = wanted.runs, wanted.starts
    out: list[Copy] = []
    for (_, s_logical, s_len), s_file in zip(src, src_offsets):
        s_end = s_logical + s_len
        i = max(0, bisect.bisect_right(starts, s_logical) - 1)
        while i < len(by_logical) and by_logical[i][1] < s_end:
            d_local, d_logical, d_len = by_logical[i]
            lo, hi = max(s_logical, d_logical), min(s_end, d_logical + d_len)
            if lo < hi:
                out.append((d_local + lo - d_logical, s_file + lo - s_logical, hi - lo))
            i += 1
    out.sort(key=lambda c: c[1])
    return out


def coalesce(copies: list[Copy], gap: int, limit: int) -> list[tuple[int, int, list[Copy]]]:
    """Group copies (sorted by source offset) into reads of one contiguous source span each:
    (span start, span end, copies). Neighbours closer than `gap` elements share a read; no
    read spans more than `limit` elements unless a single copy is longer. A read of the
    gaps too is a bounded superset of what is needed; fewer, larger reads beat one seek
    per row of a dim-1 split."""
    groups: list[tuple[int, int, list[Copy]]] = []
    for c in copies:
        _, src, length = c
        if groups:
            lo, hi, members = groups[-1]
            if src - hi <= gap and src + length - lo <= limit:
                members.append(c)
                groups[-1] = (lo, max(hi, src + length), members)
                continue
        groups.append((src, src + length, [c]))
    return groups


def pieces_cover(shards: list[TPShard]) -> str | None:
    """None when the shards' pieces cover every logical row along `dim` exactly once;
    otherwise what is wrong, for an error message."""
    first = shards[0]
    for s in shards[1:]:
        if (s.dim, s.logical_shape) != (first.dim, first.logical_shape):
            return (f"tensor-parallel pieces disagree on the split (dim {s.dim} of {s.logical_shape} "
                    f"vs dim {first.dim} of {first.logical_shape})")
    rows = sorted((logical, logical + length) for s in shards for _, logical, length in s.pieces
                  if length)
    at = 0
    for lo, hi in rows:
        if lo != at:
            return f"tensor-parallel pieces cover logical rows up to {at}, then start at {lo}"
        at = hi
    n = first.logical_shape[first.dim]
    if at != n:
        return f"tensor-parallel pieces cover logical rows [0, {at}) of {n} along dim {first.dim}"
    return None
