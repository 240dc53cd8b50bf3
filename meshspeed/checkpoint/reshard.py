"""Reading any element range of a saved parameter, whatever layout saved it.

Note [resharding is range intersection]
A checkpoint records, per parameter, which file holds which flat element range [s, e) of
it (one range per writing rank: all of it under stage 0, ceil(numel/N)-sized pieces under
ZeRO). A loading rank needs its own range [a, b) in the new layout; it reads the
intersection of [a, b) with each saved range, straight into the destination. This is the
whole of resharding: no stage or world size appears, so (dp=a, stage=s) -> (dp=b, stage=t)
needs no conversion step, and each rank reads only the bytes it will keep. Under tensor
parallelism the ranges are of each rank's local piece; Note [tensor-parallel ranges] in
tp_ranges.py maps both sides to logical positions, and the intersection is taken there.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from meshspeed.checkpoint import tp_ranges
from meshspeed.checkpoint.errors import CheckpointError
from meshspeed.checkpoint.hosts import gather_hint
from meshspeed.checkpoint.tensorfile import TensorFile, sha256_file
from meshspeed.checkpoint.tp_ranges import Copy
from meshspeed.topology.shards import TPShard


def overlaps(ranges: list[dict[str, Any]], start: int, end: int) -> Iterator[tuple[dict, int, int]]:
    """(saved range, a, b) for each saved range meeting [start, end); [a, b) is the overlap.

    Flat positions of one tensor: for parameters no side splits with tensor parallelism."""
    for r in ranges:
        a, b = max(start, r["start"]), min(end, r["end"])
        if a < b:
            yield r, a, b


def saved_shard(r: dict[str, Any]) -> TPShard | None:
    """The tensor-parallel shard a saved range was cut from (None: not split)."""
    return TPShard.from_json(r["tp"]) if r.get("tp") else None


@dataclass
class ReadPlan:
    """How to fill elements [start, end) of one rank's local parameter from a checkpoint:
    per saved range meeting it, the copies (offset in the destination, offset in the saved
    tensor, length). The same plan serves the master and every optimizer state tensor."""

    param: str
    start: int
    end: int
    wanted: int  # destination elements that are not tensor-parallel padding
    reads: list[tuple[dict[str, Any], list[Copy]]]

    @property
    def ranges(self) -> list[dict[str, Any]]:
        return [r for r, _ in self.reads]


# Reads of a saved tensor: neighbours closer than READ_GAP elements share one read, and no
# read is longer than READ_LIMIT elements (a bound on the temporary buffer), so a dim-1
# split reads a bounded superset in a few large reads instead of one read per row.
READ_GAP = 1 << 16
READ_LIMIT = 1 << 22


def plan_range(param: str, ranges: list[dict[str, Any]], start: int, end: int,
               shard: TPShard | None) -> ReadPlan:
    """Note [resharding is range intersection], generalized by Note [tensor-parallel ranges]:
    elements [start, end) of the local parameter cut by `shard` (None: the logical one)."""
    if shard is None and not any(r.get("tp") for r in ranges):  # neither side is tp-split
        reads = [(r, [(a - start, a - r["start"], b - a)]) for r, a, b in overlaps(ranges, start, end)]
        return ReadPlan(param, start, end, end - start, reads)
    wanted = tp_ranges.Wanted([(local - start, logical, n)
                               for local, logical, n in tp_ranges.runs(shard, start, end)])
    reads = []
    for r in ranges if wanted.numel else ():
        src = tp_ranges.runs(saved_shard(r), r["start"], r["end"])
        copies = tp_ranges.intersect(wanted, src, tp_ranges.file_offsets(src))
        if copies:
            reads.append((r, copies))
    return ReadPlan(param, start, end, wanted.numel, reads)


class SavedTensors:
    """The tensor files of one checkpoint directory (headers parsed once, on first use)."""

    def __init__(self, path: str, meta: dict[str, Any]):
        self.path = path
        self.meta = meta
        self._files: dict[str, TensorFile] = {}

    def file(self, name: str) -> TensorFile:
        if name not in self._files:
            self._files[name] = TensorFile(os.path.join(self.path, name))
        return self._files[name]

    def plan(self, param: str, start: int, end: int, shard: TPShard | None = None) -> ReadPlan:
        return plan_range(param, self.meta["params"][param]["ranges"], start, end, shard)

    def fill(self, param: str, kind: str, start: int, end: int, out: torch.Tensor,
             shard: TPShard | None = None) -> None:
        """Elements [start, end) of `kind` ("master" or "optim/<state>") of `param` -> out,
        for the local parameter cut by `shard` (None: the whole logical parameter)."""
        self.fill_planned(self.plan(param, start, end, shard), kind, out)

    def fill_planned(self, plan: ReadPlan, kind: str, out: torch.Tensor, gap: int = READ_GAP) -> None:
        """`gap`: pieces at most this many elements apart are read in one go (fewer, larger
        reads); 0 reads only the elements wanted (inference loading a shard of a row-split
        tensor would otherwise read all of it)."""
        flat = out.view(-1)
        if plan.wanted < plan.end - plan.start:
            flat.zero_()  # tensor-parallel padding: in no saved range, kept at zero
        key = f"{kind}/{plan.param}"
        covered = 0
        for r, copies in plan.reads:
            f = self.file(r["file"])
            for lo, hi, group in tp_ranges.coalesce(copies, gap, READ_LIMIT):
                if len(group) == 1:  # straight into the destination
                    d, src, n = group[0]
                    f.read_into(key, src, src + n, flat[d : d + n])
                else:
                    buf = torch.empty(hi - lo, dtype=f.entry(key).dtype)
                    f.read_into(key, lo, hi, buf)
                    for d, src, n in group:
                        flat[d : d + n].copy_(buf[src - lo : src - lo + n])
                covered += sum(n for _, _, n in group)
        if covered != plan.wanted:
            raise CheckpointError(f"{self.path}: elements [{plan.start}, {plan.end}) of "
                                  f"{plan.param!r} are not all in the checkpoint; it is incomplete")

    def saved_dtype(self, param: str, kind: str, plan: ReadPlan | None = None,
                    default: torch.dtype | None = None) -> torch.dtype:
        """The dtype `kind` of `param` was saved in, read from a file this rank reads anyway
        (the plan's) or one in the directory. On node-local disks a rank that holds none of
        `param` may find no such file on its host: then the dtype of `kind` for another
        parameter in a file it has, else `default` (its range is empty: nothing is read)."""
        ranges = (plan.ranges if plan is not None else []) + self.meta["params"][param]["ranges"]
        here = [r for r in ranges if os.path.isfile(os.path.join(self.path, r["file"]))]
        if here or default is None:
            return self.file((here or ranges)[0]["file"]).entry(f"{kind}/{param}").dtype
        for other, entry in self.meta["params"].items():
            for r in entry["ranges"]:
                if os.path.isfile(os.path.join(self.path, r["file"])) and \
                        f"{kind}/{other}" in self.file(r["file"]):
                    return self.file(r["file"]).entry(f"{kind}/{other}").dtype
        return default

    def read(self, file: str, key: str) -> torch.Tensor:
        return self.file(file).read(key)


def verify_file(path: str, expected: dict[str, Any]) -> None:
    """Size and SHA-256 of one file against meta.json; a one-line error naming the file."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete: restore the "
                              "file or load another tag")
    size = os.path.getsize(path)
    if size != expected["bytes"]:
        raise CheckpointError(f"{path} is {size} bytes but the checkpoint recorded "
                              f"{expected['bytes']}: the file is truncated or was replaced; restore "
                              "it or load another tag")
    if sha256_file(path) != expected["sha256"]:
        with open(path, "rb") as f:
            head = f.read(2)
        hint = (" (it looks like a pickle / torch.save file, which meshspeed never unpickles)"
                if head[:1] == b"\x80" or head == b"PK" else "")
        raise CheckpointError(f"{path} fails its SHA-256 check: the file is corrupted or was "
                              f"modified{hint}; restore it or load another tag")


def verify_files(path: str, meta: dict[str, Any], rank: int = 0, world: int = 1) -> None:
    """Check this rank's share of the files (file i is checked by rank i % world)."""
    known = set(meta["files"])
    for name, p in meta["params"].items():
        for r in p["ranges"]:
            if r["file"] not in known:
                raise CheckpointError(f"{path}: parameter {name!r} refers to {r['file']!r}, "
                                      "which the checkpoint does not list; meta.json is corrupted")
    for i, name in enumerate(sorted(known)):
        if i % world == rank:
            if os.path.basename(name) != name:
                raise CheckpointError(f"{path}: file name {name!r} in meta.json leaves the directory")
            where = os.path.join(path, name)
            if not os.path.isfile(where) and (meta.get("storage") or {}).get("node_local"):
                raise CheckpointError(f"{where} is missing: this is one host's part of a checkpoint "
                                      f"saved on node-local disks; {gather_hint(path, meta)}")
            verify_file(where, meta["files"][name])

