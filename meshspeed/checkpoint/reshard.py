"""Reading any element range of a saved parameter, whatever layout saved it.

Note [resharding is range intersection]
A checkpoint records, per parameter, which file holds which flat element range [s, e) of
it (one range per writing rank: all of it under stage 0, ceil(numel/N)-sized pieces under
ZeRO). A loading rank needs its own range [a, b) in the new layout; it reads the
intersection of [a, b) with each saved range, straight into the destination. This is the
whole of resharding: no stage or world size appears, so (dp=a, stage=s) -> (dp=b, stage=t)
needs no conversion step, and each rank reads only the bytes it will keep.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch

from meshspeed.checkpoint.errors import CheckpointError
from meshspeed.checkpoint.tensorfile import TensorFile, sha256_file


def overlaps(ranges: list[dict[str, Any]], start: int, end: int) -> Iterator[tuple[dict, int, int]]:
    """(saved range, a, b) for each saved range meeting [start, end); [a, b) is the overlap."""
    for r in ranges:
        a, b = max(start, r["start"]), min(end, r["end"])
        if a < b:
            yield r, a, b


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

    def fill(self, param: str, kind: str, start: int, end: int, out: torch.Tensor) -> None:
        """Elements [start, end) of `kind` ("master" or "optim/<state>") of `param` -> out."""
        ranges = self.meta["params"][param]["ranges"]
        flat = out.view(-1)
        covered = 0
        for r, a, b in overlaps(ranges, start, end):
            f = self.file(r["file"])
            f.read_into(f"{kind}/{param}", a - r["start"], b - r["start"], flat[a - start : b - start])
            covered += b - a
        if covered != end - start:
            raise CheckpointError(f"{self.path}: elements [{start}, {end}) of {param!r} are not all "
                                  "in the checkpoint; it is incomplete")

    def saved_dtype(self, param: str, kind: str) -> torch.dtype:
        r = self.meta["params"][param]["ranges"][0]
        return self.file(r["file"]).entry(f"{kind}/{param}").dtype

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
            verify_file(os.path.join(path, name), meta["files"][name])

