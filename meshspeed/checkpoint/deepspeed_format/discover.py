"""Finding a DeepSpeed checkpoint on disk: the tag directory and its files.

    <save_dir>/latest                               the tag (text)
    <save_dir>/<tag>/mp_rank_00_model_states.pt     stages 0-2: weights, counters, client state
    <tag>/zero_pp_rank_<d>_mp_rank_00_model_states.pt      stage 3: one per dp rank
    <tag>/[bf16_]zero_pp_rank_<d>_mp_rank_00_optim_states.pt  ZeRO: one per dp rank
    <tag>/layer_<LL>-model_states.pt                a pipeline's layers
    <tag>/zero/<param>/fp32.pt                      a universal checkpoint (ds_to_universal)

`mp_rank_XX` is the tensor-parallel rank. Only names are read here; no file is opened.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field

from meshspeed.checkpoint.errors import CheckpointError

_MODEL = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_LAYER = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$|^layer_(\d+)-model_states\.pt$")


@dataclass
class TagFiles:
    """The files of one DeepSpeed tag directory, by kind and rank."""

    path: str
    model: dict[tuple[int, int], str] = field(default_factory=dict)  # (dp, tp) -> file (dp 0 below stage 3)
    optim: dict[tuple[int, int], str] = field(default_factory=dict)  # (dp, tp) -> file
    layers: dict[tuple[int, int], str] = field(default_factory=dict)  # (layer, tp) -> file
    universal: bool = False

    @property
    def tp_size(self) -> int:
        return 1 + max([tp for _, tp in self.model] or [0])

    @property
    def dp_size(self) -> int:
        return 1 + max([dp for dp, _ in self.optim] or [0])


def scan(path: str) -> TagFiles | None:
    """The DeepSpeed files in `path`, or None when it holds none."""
    if not os.path.isdir(path):
        return None
    found = TagFiles(path)
    for name in sorted(os.listdir(path)):
        if m := _MODEL.match(name):
            found.model[(int(m.group(1) or 0), int(m.group(2)))] = os.path.join(path, name)
        elif m := _OPTIM.match(name):
            found.optim[(int(m.group(2)), int(m.group(3)))] = os.path.join(path, name)
        elif m := _LAYER.match(name):
            layer = int(m.group(1) if m.group(1) is not None else m.group(3))
            tp = int(m.group(2)) if m.group(2) is not None else 0
            found.layers[(layer, tp)] = os.path.join(path, name)
    found.universal = bool(glob.glob(os.path.join(glob.escape(path), "zero", "*", "fp32.pt")))
    if not found.model and not found.layers:
        return None
    return found


def find_tag(load_dir: str, tag: str | None) -> TagFiles | None:
    """The DeepSpeed tag to load from `load_dir` (its `latest`, or `tag`), or `load_dir`
    itself when it is a tag directory; None when `load_dir` is not a DeepSpeed checkpoint.
    A `latest` that names a missing tag is a CheckpointError."""
    load_dir = os.fspath(load_dir)
    if tag is None:
        here = scan(load_dir)
        if here is not None:
            return here
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            return None
        with open(latest, encoding="utf-8") as f:
            tag = f.read().strip()
        if os.path.isfile(os.path.join(load_dir, tag, "meta.json")):
            return None  # a meshspeed checkpoint
        if not tag or "/" in tag or tag in (".", ".."):
            return None
        found = scan(os.path.join(load_dir, tag))
        if found is None and os.path.isdir(os.path.join(load_dir, tag)) and _looks_deepspeed(load_dir):
            raise CheckpointError(f"{os.path.join(load_dir, tag)} (named by {latest}) holds no DeepSpeed "
                                  "model states file (mp_rank_00_model_states.pt); the checkpoint is "
                                  "incomplete, pass another tag")
        return found
    if "/" in str(tag) or str(tag) in (".", ".."):
        return None
    return scan(os.path.join(load_dir, str(tag)))


def _looks_deepspeed(load_dir: str) -> bool:
    return any(scan(d) is not None for d in glob.glob(os.path.join(glob.escape(load_dir), "*")))
