"""A DeepSpeed pipeline checkpoint (`PipelineModule`) read as one checkpoint of whole tensors.

    <tag>/layer_<LL>-model_states.pt          layer LL's state_dict (keys without the layer prefix)
    <tag>/mp_rank_<SS>_model_states.pt        stage SS's engine state ("module" is None)
    <tag>/zero_pp_rank_<d>_mp_rank_<SS>_optim_states.pt   ZeRO 1: stage SS, dp rank d

Each stage's model-states file is read as a one-rank DeepSpeed checkpoint (read.py) whose
`module` is assembled from the layer files of that stage's layers, named as both
DeepSpeed's and meshspeed's `PipelineModule` name them: "<global layer index>.<name in the
layer>" (Note [which layers a stage held]). The stages are then read one after another
(multi.Stages), so the result names every parameter of the model once and meshspeed's
loader places each one on whichever stage, or non-pipeline module, holds that name.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from meshspeed.checkpoint.deepspeed_format.discover import TagFiles
from meshspeed.checkpoint.deepspeed_format.multi import Stages
from meshspeed.checkpoint.deepspeed_format.read import DeepSpeedCheckpoint, read_tag
from meshspeed.checkpoint.deepspeed_format.unpickle import load_torch_file
from meshspeed.checkpoint.errors import CheckpointError

_LAYER_NAME = re.compile(r"^(\d+)\.")


def _layer_states(files: TagFiles) -> dict[int, dict[str, torch.Tensor]]:
    tps = {tp for _, tp in files.layers}
    if tps != {0}:
        raise CheckpointError(f"{files.path} is a DeepSpeed pipeline checkpoint with tensor parallelism "
                              f"(layer_*-model_<tp>-model_states.pt for tp ranks {sorted(tps)}); reading "
                              "pipeline x tensor parallelism is not supported: convert it at tp 1")
    out = {}
    for (layer, _), path in sorted(files.layers.items()):
        sd = load_torch_file(path)
        if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
            raise CheckpointError(f"{path} is not a DeepSpeed pipeline layer file (a state dict of tensors)")
        out[layer] = sd
    return out


# Note [which layers a stage held]
# The layer files do not say which stage saved them. With ZeRO 1 each stage's
# model-states file lists its parameter names (`param_shapes`, "<layer>.<name>"), which
# settles it. Without ZeRO the stage's optimizer state lists parameter indices only: the
# stage's parameters are then the next ones in layer order, as many as its optimizer holds
# (stages own consecutive layers, and a layer's parameters come in its state_dict's
# order, the order named_parameters() gives). Either way the shapes are checked against
# the layer files when the stage is read (read.py). A tied layer (TiedLayerSpec) is named
# "tied_modules.<key>.<name>" by the engine, a name no layer file carries: refused.
def _stage_names(header: dict[str, Any], ordered: list[str], numels: dict[str, int], used: int,
                 path: str) -> list[str]:
    if header.get("param_shapes"):
        names = [n for g in header["param_shapes"] for n in g]
        for n in names:
            if not _LAYER_NAME.match(n):
                raise CheckpointError(f"{path} names parameter {n!r}, not a '<layer>.<name>' of a layer "
                                      "file (a TiedLayerSpec?); tied pipeline layers are not read yet")
        return names
    opt = header.get("optimizer")
    if not opt:
        return ordered[used:]  # weights only: the rest (only the last stage may say so)
    if "fp32_groups_flat" in opt:
        numel, names = sum(t.numel() for t in opt["fp32_groups_flat"]), []
        while numel > 0 and used + len(names) < len(ordered):
            names.append(ordered[used + len(names)])
            numel -= numels[names[-1]]
        return names
    count = sum(len(g["params"]) for g in opt["param_groups"])
    return ordered[used:used + count]


def read_pipeline(files: TagFiles) -> Stages:
    """The pipeline tag `files` as one checkpoint (see the module docstring)."""
    layers = _layer_states(files)
    mp_ranks = sorted({tp for dp, tp in files.model if dp == 0})
    headers = [load_torch_file(files.model[(0, m)]) for m in mp_ranks]
    dims = (headers[0].get("checkpoint_parallel_dimensions") or {}) if headers else {}
    if int(dims.get("tp_degree", 1)) != 1:
        raise CheckpointError(f"{files.path} is a DeepSpeed pipeline checkpoint at tp {dims['tp_degree']}; "
                              "reading pipeline x tensor parallelism is not supported")
    if mp_ranks != list(range(len(mp_ranks))) or len(mp_ranks) != int(dims.get("pp_degree", len(mp_ranks))):
        raise CheckpointError(f"{files.path} holds model states files for stages {mp_ranks} but was saved "
                              f"with {dims.get('pp_degree')} pipeline stages; the checkpoint is incomplete")
    buffers = {b for h in headers for b in h.get("buffer_names") or []}
    every: dict[str, torch.Tensor] = {}
    for layer, sd in layers.items():
        for key, t in sd.items():
            every[f"{layer}.{key}"] = t
    ordered = [n for n in every if n not in buffers]
    numels = {n: every[n].numel() for n in ordered}
    parts: list[DeepSpeedCheckpoint] = []
    used = 0
    for m, header in zip(mp_ranks, headers):
        where = files.model[(0, m)]
        if header.get("module") is not None:
            raise CheckpointError(f"{where} holds a module state dict, which a pipeline stage's "
                                  "model-states file does not; the files do not belong together")
        names = _stage_names(header, ordered, numels, used, where)
        missing = [n for n in names if n not in every]
        if missing:
            raise CheckpointError(f"{where} names parameter {missing[0]!r}, which no layer file of "
                                  f"{files.path} holds; the checkpoint is incomplete")
        used += len(names)
        own = [b for b in header.get("buffer_names") or [] if b in every]
        header = {**header, "module": {n: every[n] for n in [*names, *own]}}
        parts.append(read_tag(files, m, header))
    left = [n for n in ordered if n not in {x for p in parts for x in p.all_param_names()}]
    if left:
        raise CheckpointError(f"{files.path}: the layer files hold {left[0]!r} (and {len(left) - 1} more), "
                              "which no stage's optimizer state covers; the files do not belong together")
    return Stages(parts, files.path)
