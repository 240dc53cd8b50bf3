"""meta.json: everything in a checkpoint that is not a tensor.

Written by global rank 0 once every rank's file is durable. Its parts:

    format, version, tag, created
    layout        how the run that saved was laid out: world_size, dp_size, tp_size,
                  zero_stage, compute_dtype (informative: loading never needs it to match)
    params        name -> LOGICAL (whole) shape, dtype, requires_grad, and `ranges`: which
                  rank's file holds which flat element range [start, end) of the fp32
                  master, with the names of the optimizer state tensors saved for that
                  range and the scalar optimizer state ("step") of the parameter. Under
                  tensor parallelism a range of a split parameter also has `tp` (the
                  TPShard, `TPShard.to_json()`): [start, end) is then of that tp rank's
                  local piece, and the saved tensor holds the range's elements without
                  the padding (Note [tensor-parallel ranges] in tp_ranges.py); a range
                  without `tp` is of the logical parameter
    aliases       tied parameters: state_dict name -> the name saved under `params`
    buffers       persistent buffers (in rank 0's file)
    optimizer     class name and param groups (options + parameter names)
    lr_scheduler, loss_scaler, counters, data, config, client_state
    ranks         per rank: its file and its RNG states
    files         file name -> bytes, sha256 (checked before any tensor is read)
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import torch

from meshspeed import comm
from meshspeed.checkpoint.atomic import read_json
from meshspeed.checkpoint.errors import CheckpointError
from meshspeed.checkpoint.paths import META
from meshspeed.checkpoint.tp_ranges import logical_shape, pieces_cover
from meshspeed.topology.shards import TPShard

FORMAT = "meshspeed-checkpoint"
VERSION = 1


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint metadata")
    return dtype


def json_options(options: dict[str, Any], where: str) -> dict[str, Any]:
    """Optimizer param-group options as JSON (tuples become lists)."""
    out = {}
    for k, v in options.items():
        if k == "params":
            continue
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, tuple):
            v = list(v)
        if not (v is None or isinstance(v, (bool, int, float, str))
                or (isinstance(v, list) and all(isinstance(x, (bool, int, float)) for x in v))):
            raise CheckpointError(f"{where}: option {k!r} = {v!r} is not a JSON value; "
                                  "meshspeed checkpoints never pickle")
        out[k] = v
    return out


def param_spec(s) -> dict[str, Any]:
    """What meta.json says of a saved parameter besides its ranges (an OwnedSlice `s`)."""
    return {"shape": list(logical_shape(s)), "dtype": dtype_name(s.dtype), "requires_grad": bool(s.requires_grad)}


def global_meta(engine, tag: str, slices, aliases: dict[str, str], buffers: dict[str, torch.Tensor],
                client_json: Any, client_keys: list[str], tp_size: int = 1) -> dict[str, Any]:
    """The rank-independent part of meta.json, built on rank 0 at save time."""
    name_of = {id(s.key): s.name for s in slices}
    opt = engine.optimizer
    groups = [{"options": json_options(g, f"optimizer param group {i}"),
               "params": [name_of.get(id(p), "?") for p in g["params"]]}
              for i, g in enumerate(opt.param_groups)]
    sched = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    loader = engine.training_dataloader
    sampler = getattr(loader, "sampler", None)
    epoch = getattr(sampler, "epoch", None)
    # Note [resuming the data order] (meshspeed/data/loader.py): where the loader is
    position = loader.state_dict() if callable(getattr(loader, "state_dict", None)) else None
    return {
        "format": FORMAT,
        "version": VERSION,
        "tag": tag,
        "created": time.time(),
        "layout": {"world_size": comm.get_world_size(), "dp_size": engine.topology.size("dp"),
                   "tp_size": tp_size, "zero_stage": engine.config.zero_stage,
                   "compute_dtype": dtype_name(engine.config.precision_dtype)},
        "params": {s.name: {**param_spec(s), "ranges": []} for s in slices},
        "aliases": aliases,
        "buffers": {k: {"shape": list(b.shape), "dtype": dtype_name(b.dtype)} for k, b in buffers.items()},
        "optimizer": {"class": type(opt).__name__, "param_groups": groups},
        "lr_scheduler": sched,
        "loss_scaler": engine.loss_scaler.state_dict(),
        "counters": {"global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
                     "global_samples": engine.global_samples, "skipped_steps": engine.skipped_steps},
        "data": {"global_samples": engine.global_samples, "micro_steps": engine.micro_steps,
                 "gradient_accumulation_steps": engine.config.gradient_accumulation_steps,
                 "micro_batch_size": engine.config.train_micro_batch_size_per_gpu,
                 "dp_size": engine.topology.size("dp"),
                 "sampler_epoch": epoch if isinstance(epoch, int) else None,
                 "loader": position},
        "config": engine.config.to_dict(),
        "client_state": client_json,
        "client_tensors": client_keys,
        "ranks": [],
        "files": {},
    }


def merge_rank(meta: dict[str, Any], info: dict[str, Any]) -> None:
    """Fold one rank's marker (its ranges, file checksum and RNG) into meta.json."""
    rank, file = info["rank"], info["file"]
    for name, spec in info.get("params", {}).items():  # Note [a checkpoint of pipeline stages]
        meta["params"].setdefault(name, {**spec, "ranges": []})
    for name, spec in info.get("buffers", {}).items():
        meta["buffers"].setdefault(name, {**spec, "file": file})
    for name, r in info["ranges"].items():
        entry = meta["params"][name]
        saved = {"rank": rank, "file": file, "start": r["start"], "end": r["end"],
                 "optimizer": r["optimizer"]}
        if r.get("tp"):
            saved["tp"] = r["tp"]
        entry["ranges"].append(saved)
        if (r["optimizer"] or r["scalars"]) and "optimizer_scalars" not in entry:  # has state
            entry["optimizer_scalars"] = r["scalars"]
    meta["ranks"].append({"rank": rank, "file": file, "rng": info["rng"],
                          **({"rank_state": info["rank_state"]} if info.get("rank_state") else {})})
    meta["files"][file] = {"bytes": info["bytes"], "sha256": info["sha256"]}


def _chain(ranges: list[dict[str, Any]], numel: int) -> int:
    """How far the ranges, sorted, cover [0, numel) without a gap (numel when all of it)."""
    pos = 0
    for r in sorted(ranges, key=lambda r: r["start"]):
        if r["start"] != pos:
            break
        pos = r["end"]
    return pos


def check_coverage(meta: dict[str, Any]) -> None:
    """Every element of every parameter is in exactly one saved range: of the logical
    parameter, or, for a tensor-parallel one, of each tp rank's local piece, and the
    pieces cover the logical parameter (Note [tensor-parallel ranges])."""
    for name, p in meta["params"].items():
        split = [r for r in p["ranges"] if r.get("tp")]
        if not split:
            numel = math.prod(p["shape"])
            pos = _chain(p["ranges"], numel)
            if pos != numel:
                raise CheckpointError(f"checkpoint metadata is inconsistent: parameter {name!r} has "
                                      f"saved ranges covering [0, {pos}) of {numel} elements")
            continue
        if len(split) != len(p["ranges"]):
            raise CheckpointError(f"checkpoint metadata is inconsistent: parameter {name!r} has "
                                  "ranges with and without a tensor-parallel shard")
        by_rank: dict[int, list[dict[str, Any]]] = {}
        for r in split:
            by_rank.setdefault(int(r["tp"]["tp_rank"]), []).append(r)
        shards = []
        for tp_rank, ranges in sorted(by_rank.items()):
            try:
                shard = TPShard.from_json(ranges[0]["tp"])
            except (KeyError, TypeError, ValueError) as err:
                raise CheckpointError(f"checkpoint metadata is inconsistent: parameter {name!r} has "
                                      f"a bad tensor-parallel shard: {_one_line(err)}") from None
            if any(r["tp"] != ranges[0]["tp"] for r in ranges) or list(shard.logical_shape) != list(p["shape"]):
                raise CheckpointError(f"checkpoint metadata is inconsistent: parameter {name!r} of "
                                      f"shape {tuple(p['shape'])} has differing shards for tp rank {tp_rank}")
            numel = math.prod(shard.local_shape)
            pos = _chain(ranges, numel)
            if pos != numel:
                raise CheckpointError(f"checkpoint metadata is inconsistent: parameter {name!r} has "
                                      f"saved ranges covering [0, {pos}) of the {numel} elements of "
                                      f"tp rank {tp_rank}'s piece")
            shards.append(shard)
        problem = pieces_cover(shards)
        if problem:
            raise CheckpointError(f"checkpoint metadata is inconsistent: parameter {name!r}: {problem}")


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def read_meta(path: str) -> dict[str, Any]:
    meta_path = os.path.join(path, META)
    meta = read_json(meta_path, "checkpoint metadata")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path} is not meshspeed checkpoint metadata "
                              "(a DeepSpeed checkpoint needs converting first)")
    if meta.get("version", 0) > VERSION:
        raise CheckpointError(f"{meta_path} has format version {meta['version']}, newer than this "
                              f"meshspeed understands ({VERSION}); upgrade meshspeed")
    check_coverage(meta)
    return meta
