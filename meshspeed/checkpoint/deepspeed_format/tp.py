"""A DeepSpeed tensor-parallel checkpoint (AutoTP, `"tensor_parallel": {"autotp_size": N}`)
read as one checkpoint of whole tensors.

    <tag>/mp_rank_<TT>_model_states.pt                 tp rank TT's pieces of the weights
    <tag>/zero_pp_rank_<d>_mp_rank_<TT>_optim_states.pt  ZeRO: tp rank TT, dp rank d

Each tp rank's files are read as a one-rank DeepSpeed checkpoint (read.py), and every
parameter is joined from the ranks' pieces (multi.Pieces) as Note [how AutoTP pieces join]
says. meshspeed's loader then splits the whole tensors again for the engine's tp size.
"""

from __future__ import annotations

import re
from typing import Any

from meshspeed.checkpoint.deepspeed_format.discover import TagFiles
from meshspeed.checkpoint.deepspeed_format.multi import Pieces
from meshspeed.checkpoint.deepspeed_format.read import read_tag
from meshspeed.checkpoint.deepspeed_format.unpickle import load_torch_file
from meshspeed.checkpoint.errors import CheckpointError

# Note [how AutoTP pieces join]
# DeepSpeed 0.19's AutoTP writes, into every tp rank's model-states file,
# `universal_checkpoint_info`: regex patterns naming the parameters each rank holds whole
# (`tp_replicated_parameter_patterns`), those split along dim 1 (row-parallel linears:
# `parameter_with_row_parallelism_patterns`), and the vocabulary ones (split along dim 0
# and padded: `vocabulary_parameter_patterns`, cut back to `original_vocab_size`); every
# other parameter is split along dim 0, in tp-rank order. That is the rule its own
# ds_to_universal applies. Fused parameters split per sub-parameter (q|k|v packed in one
# tensor: `parameter_with_sub_params`, `parameter_with_2_sub_params_cat_dim_0`) would need
# their sub-shapes: refused. `affine_map`, when present, gives each parameter's logical
# shape (`affine_map["params"][pattern]["logical_shape"]`), which the joined shape is
# checked against.
_FUSED = ("parameter_with_sub_params", "parameter_with_2_sub_params_cat_dim_0")


def _patterns(info: dict[str, Any], key: str) -> list[re.Pattern]:
    return [re.compile(p) for p in info.get(key) or []]


def _matches(patterns: list[re.Pattern], name: str) -> bool:
    return any(p.match(name) for p in patterns)


def join_rule(info: dict[str, Any], names: list[str], where: str) -> tuple[dict[str, int | None], dict[str, int]]:
    """Per parameter: the dim its pieces join along (None: replicated), and the sizes to cut
    padded vocabularies back to (Note [how AutoTP pieces join])."""
    for key in _FUSED:
        fused = [n for n in names if _matches(_patterns(info, key), n)]
        if fused:
            raise CheckpointError(f"{where}: parameter {fused[0]!r} is a fused tensor-parallel parameter "
                                  f"({key}); joining its pieces is not supported: convert the checkpoint "
                                  "with DeepSpeed's ds_to_universal and load that")
    replicated = _patterns(info, "tp_replicated_parameter_patterns")
    rows = _patterns(info, "parameter_with_row_parallelism_patterns")
    vocab = _patterns(info, "vocabulary_parameter_patterns")
    dims: dict[str, int | None] = {}
    trim: dict[str, int] = {}
    for n in names:
        if _matches(replicated, n):
            dims[n] = None
        elif _matches(rows, n):
            dims[n] = 1
        else:
            dims[n] = 0
            if _matches(vocab, n) and info.get("original_vocab_size"):
                trim[n] = int(info["original_vocab_size"])
    return dims, trim


def _check_logical(info: dict[str, Any], ckpt: Pieces, where: str) -> None:
    amap = info.get("affine_map") or {}
    for pattern, entry in (amap.get("params") or {}).items() if isinstance(amap, dict) else ():
        shape = tuple(entry.get("logical_shape") or ()) if isinstance(entry, dict) else ()
        for n, got in ckpt.shapes.items():
            if shape and re.match(pattern, n) and tuple(got) != shape:
                raise CheckpointError(f"{where}: parameter {n!r} joins to shape {tuple(got)} but DeepSpeed "
                                      f"recorded its logical shape as {shape}; the files do not belong together")


def read_tensor_parallel(files: TagFiles, model_shapes: dict[str, tuple[int, ...]] | None = None) -> Pieces:
    """The tensor-parallel tag `files` as one checkpoint (see the module docstring).
    `model_shapes` is unused: the rule comes from the files (kept for kinds.open_tag)."""
    tp = files.tp_size
    missing = [t for t in range(tp) if (0, t) not in files.model]
    if missing:
        raise CheckpointError(f"{files.path} is missing tp rank {missing[0]}'s model states file "
                              f"(mp_rank_{missing[0]:02d}_model_states.pt); the checkpoint is incomplete")
    headers = [load_torch_file(files.model[(0, t)]) for t in range(tp)]
    where = files.model[(0, 0)]
    dims = headers[0].get("checkpoint_parallel_dimensions") or {}
    if int(dims.get("pp_degree", 1)) != 1:
        raise CheckpointError(f"{files.path} is a DeepSpeed checkpoint at pp {dims['pp_degree']} x tp "
                              f"{dims.get('tp_degree')}; reading pipeline x tensor parallelism is not supported")
    info = headers[0].get("universal_checkpoint_info")
    if not isinstance(info, dict):
        raise CheckpointError(f"{where} has no universal_checkpoint_info, which says how DeepSpeed's "
                              "tensor-parallel pieces join (AutoTP writes it; Megatron-style models must "
                              "provide it); convert the checkpoint with DeepSpeed's ds_to_universal and load that")
    parts = [read_tag(files, t, h) for t, h in enumerate(headers)]
    split, trim = join_rule(info, parts[0].all_param_names(), where)
    ckpt = Pieces(parts, files.path, split, trim)
    _check_logical(info, ckpt, where)
    return ckpt
