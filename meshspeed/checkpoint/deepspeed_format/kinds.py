"""Which kind of DeepSpeed checkpoint a tag is, and the reader for it.

    ckpt = open_tag(files)     # read.DeepSpeedCheckpoint, or multi.Stages / multi.Pieces

A plain tag (one model-parallel rank) is read by read.py; a pipeline one (layer files)
by pipe.py; a tensor-parallel one (mp_rank_01 ...) by tp.py; a universal one
(`zero/<param>/fp32.pt`, ds_to_universal's output) by universal.py. All offer the same
reading interface to to_meshspeed.py and consolidate.py.
"""

from __future__ import annotations

from typing import Any

from meshspeed.checkpoint.deepspeed_format.discover import TagFiles
from meshspeed.checkpoint.deepspeed_format.pipe import read_pipeline
from meshspeed.checkpoint.deepspeed_format.read import read_tag
from meshspeed.checkpoint.deepspeed_format.tp import read_tensor_parallel
from meshspeed.checkpoint.deepspeed_format.universal import read_universal


def open_tag(files: TagFiles, model_shapes: dict[str, tuple[int, ...]] | None = None) -> Any:
    """The DeepSpeed tag `files`, opened by the reader of its kind. `model_shapes`: the
    whole (logical) shapes of the model it is loaded into, when known, which settles how
    tensor-parallel pieces join (tp.py)."""
    if files.universal:
        return read_universal(files)
    if files.layers:
        return read_pipeline(files)
    if files.tp_size > 1:
        return read_tensor_parallel(files, model_shapes)
    return read_tag(files)
