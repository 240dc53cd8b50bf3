"""A DeepSpeed tag rewritten as a meshspeed checkpoint (dp 1, whole tensors).

    write_meshspeed_tag(ckpt, out_dir, tag)    # out_dir/<tag>/meta.json, rank-00000.safetensors

meshspeed's loader then reads it like any of its own checkpoints and reshards it to the
engine's layout (any dp size, ZeRO stage, tp): Note [importing through meshspeed's
format]. One parameter is in memory at a time: the file's header is written first (the
shapes are known from the DeepSpeed headers), then each parameter's master and moments.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import torch

from meshspeed.checkpoint.atomic import publish_dir, write_json
from meshspeed.checkpoint.deepspeed_format.read import DeepSpeedCheckpoint
from meshspeed.checkpoint.errors import CheckpointError
from meshspeed.checkpoint.jsonable import encode_client_state
from meshspeed.checkpoint.metadata import FORMAT, VERSION, dtype_name
from meshspeed.checkpoint.paths import CLIENT_TENSORS, META, rank_file
from meshspeed.checkpoint.tensorfile import Spec, TensorFileWriter, write_tensors

# Note [importing through meshspeed's format]
# Reading a DeepSpeed checkpoint straight into an engine would need a second loader that
# knows every strategy's layout. Instead the DeepSpeed tag is rewritten as what a one-rank
# meshspeed run would have saved (every parameter one range [0, numel) in rank 0's file,
# fp32 masters and Adam moments, step as torch's Adam keeps it), and the ordinary loader
# (load.py) reshards it to the engine's layout, with every check it makes. DeepSpeed does
# not save RNG states, so the rank entry has none and the loader leaves them alone, as
# DeepSpeed's own load does. The cost is one extra copy of the training state on disk,
# written once, in a temporary directory removed after the load.

_STEP_AS_TORCH = {"dtype": "float32", "shape": [], "on_device": False}  # torch.optim.Adam's step


def scaler_state(ckpt: DeepSpeedCheckpoint) -> dict[str, Any] | None:
    """DeepSpeed's loss-scaler attributes in meshspeed's names (optim/loss_scaler.py)."""
    s = ckpt.loss_scaler
    if not s or "cur_scale" not in s:
        return None
    if not s.get("dynamic"):
        return {"scale": float(s["cur_scale"])}
    fp16 = ckpt.config.get("fp16") or {}
    last = s.get("last_overflow_iter")
    return {"scale": float(s["cur_scale"]),
            "hysteresis_left": int(s.get("cur_hysteresis", fp16.get("hysteresis", 2))),
            # DeepSpeed grows the scale when (cur_iter - last_overflow_iter - 1) is a multiple
            # of the window; meshspeed counts the same steps as good_steps
            "good_steps": max(0, int(s.get("cur_iter", 0)) - int(-1 if last is None else last) - 1),
            "overflows_at_min": 0}


def _group_options(options: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in options.items():
        if isinstance(v, tuple):
            v = list(v)
        if v is None or isinstance(v, (bool, int, float, str)) or (
                isinstance(v, list) and all(isinstance(x, (bool, int, float)) for x in v)):
            out[k] = v
    return out


def _meta(ckpt: DeepSpeedCheckpoint, tag: str, params: dict[str, Any], client_json: Any,
          client_keys: list[str]) -> dict[str, Any]:
    cfg = ckpt.config
    micro = int(cfg.get("train_micro_batch_size_per_gpu") or 0) or None
    gas = int(cfg.get("gradient_accumulation_steps") or 1)
    c = ckpt.counters
    return {
        "format": FORMAT, "version": VERSION, "tag": tag, "created": time.time(),
        "layout": {"world_size": 1, "dp_size": 1, "tp_size": 1, "zero_stage": ckpt.stage,
                   "compute_dtype": {"bf16": "bfloat16", "fp16": "float16"}.get(ckpt.precision, "float32"),
                   "imported_from": {"format": "deepspeed", "path": os.path.abspath(ckpt.path),
                                     "dp_size": ckpt.dp_size, "zero_stage": ckpt.stage,
                                     "ds_version": ckpt.header.get("ds_version")}},
        "params": params,
        "aliases": {a: n for a, n in ckpt.aliases.items() if n in params},
        "buffers": {k: {"shape": list(b.shape), "dtype": dtype_name(b.dtype)} for k, b in ckpt.buffers.items()},
        "optimizer": {"class": "Adam", "param_groups": [
            {"options": _group_options(o), "params": names}
            for o, names in zip(ckpt.group_options, ckpt.group_names)]},
        "lr_scheduler": ckpt.lr_scheduler,
        "loss_scaler": scaler_state(ckpt) or {},
        "counters": {**c, "micro_steps": c["global_steps"] * gas},
        "data": {"global_samples": c["global_samples"], "micro_steps": c["global_steps"] * gas,
                 "gradient_accumulation_steps": gas, "micro_batch_size": micro,
                 "dp_size": ckpt.dp_size, "sampler_epoch": None, "loader": None},
        "config": cfg,
        "client_state": client_json,
        "client_tensors": client_keys,
        "ranks": [{"rank": 0, "file": rank_file(0), "rng": None}],
        "files": {},
    }


def _specs(ckpt: DeepSpeedCheckpoint) -> list[Spec]:
    specs = []
    for name in ckpt.all_param_names():
        shape = ckpt.shapes[name]
        specs.append(Spec(f"master/{name}", torch.float32, shape))
        specs += [Spec(f"optim/{k}/{name}", torch.float32, shape) for k in ckpt.moment_keys(name)]
    specs += [Spec(f"buffer/{n}", b.dtype, tuple(b.shape)) for n, b in ckpt.buffers.items()]
    return specs


def write_meshspeed_tag(ckpt: DeepSpeedCheckpoint, out_dir: str, tag: str) -> str:
    """Write `ckpt` as the meshspeed checkpoint `<out_dir>/<tag>` (atomically: a temporary
    directory renamed at the end) and return its path."""
    final = os.path.join(out_dir, tag)
    tmp = f"{final}.tmp-import"
    os.makedirs(tmp, exist_ok=False)
    client_json, client_tensors = encode_client_state(ckpt.client_state)
    files: dict[str, Any] = {}
    params: dict[str, Any] = {}
    path = os.path.join(tmp, rank_file(0))
    with TensorFileWriter(path, _specs(ckpt)) as w:
        for p in ckpt.params():
            if tuple(p.master.shape) != ckpt.shapes[p.name]:
                raise CheckpointError(f"{ckpt.path}: parameter {p.name!r} reads as shape "
                                      f"{tuple(p.master.shape)} but its saved shape is {ckpt.shapes[p.name]}")
            w.write(f"master/{p.name}", p.master)
            keys = ckpt.moment_keys(p.name)
            for k in keys:
                w.write(f"optim/{k}/{p.name}", p.moments[k].float())
            entry: dict[str, Any] = {"shape": list(p.master.shape), "dtype": "float32",
                                     "requires_grad": p.name in ckpt.trainable,
                                     "ranges": [{"rank": 0, "file": rank_file(0), "start": 0,
                                                 "end": math.prod(p.master.shape), "optimizer": keys}]}
            if p.step is not None:
                entry["optimizer_scalars"] = {"step": {"value": float(p.step), **_STEP_AS_TORCH}}
            params[p.name] = entry
            del p
        for n, b in ckpt.buffers.items():
            w.write(f"buffer/{n}", b)
    files[rank_file(0)] = {"bytes": w.nbytes, "sha256": w.sha256}
    if client_tensors:
        nbytes, sha = write_tensors(os.path.join(tmp, CLIENT_TENSORS), client_tensors)
        files[CLIENT_TENSORS] = {"bytes": nbytes, "sha256": sha}
    meta = _meta(ckpt, tag, params, client_json, list(client_tensors))
    meta["files"] = files
    write_json(os.path.join(tmp, META), meta)
    publish_dir(tmp, final)
    return final
