"""Export: a meshspeed checkpoint tag -> the files DeepSpeed 0.19.8 writes for it.

    export(ckpt_dir, out_dir, dp=2, zero_stage=1)   # <out_dir>/<tag>/*.pt, then <out_dir>/latest
    write_files(store, dest, target)                 # the .pt files only, into an existing directory

What each file holds, and in which of DeepSpeed's layouts, is in Note [DeepSpeed's flat
partitions] (layout.py) and the functions below; the records DeepSpeed pickles as its own
classes are written as in Note [naming DeepSpeed's classes without importing them]
(picklewriter.py). The source is read through meshspeed's own range reader
(`SavedTensors`): each rank's partition is filled straight from the saved ranges, so the
exporter holds one output file's tensors at a time (DeepSpeed's files are single pickles:
a file is built whole before it is written), and never the optimizer state of the whole
model unless one file holds it (stage 0).

Note [what DeepSpeed's optimizer expects of the step]
DeepSpeed's FusedAdam keeps `step` per parameter but applies the step count of the last
parameter of each param group to the whole group (the loop variable outlives the loop),
and its saved state shows it: 0 on every parameter but the last. The exporter writes
exactly that, with the step meshspeed saved, so DeepSpeed continues with meshspeed's bias
correction. ZeRO's flat groups have one tensor per (sub-)group and carry the step on it.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from meshspeed.checkpoint.atomic import publish_dir, remove_tree, write_text
from meshspeed.checkpoint.deepspeed_format import layout, picklewriter, scaler
from meshspeed.checkpoint.errors import CheckpointError
from meshspeed.checkpoint.jsonable import decode_client_state
from meshspeed.checkpoint.metadata import dtype_from_name, read_meta
from meshspeed.checkpoint.paths import CLIENT_TENSORS, check_tag, resolve
from meshspeed.checkpoint.reshard import SavedTensors, verify_files
from meshspeed.checkpoint.writer import prepare

DS_VERSION = "0.19.8"
# DeepSpeed's own schedules save only their position (their state_dict() is this one key)
DS_SCHEDULES = {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"}
# the param-group options DeepSpeed's FusedAdam has, in its order
FUSED_ADAM_OPTIONS = ("lr", "bias_correction", "betas", "eps", "weight_decay")
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000


@dataclass(frozen=True)
class Target:
    """The DeepSpeed layout to write."""

    dp: int
    stage: int
    dtype: torch.dtype  # the compute dtype: module weights; masters are fp32 whatever it is
    exclude_frozen: bool = False

    @property
    def bf16(self) -> bool:
        return self.dtype == torch.bfloat16

    @property
    def mixed(self) -> bool:
        """bf16 or fp16: stage 0 wraps the optimizer in DeepSpeed's FP16_Optimizer."""
        return self.dtype in (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Group:
    """One optimizer param group: DeepSpeed's options and its trainable parameters."""

    options: dict[str, Any]
    params: list[tuple[str, int]]  # (name, numel), in the group's order
    states: list[str]  # optimizer state tensors saved for the group ("exp_avg", ...)
    step: int


def target_for(meta: dict, dp: int | None, zero_stage: int | None, exclude_frozen: bool = False) -> Target:
    """The layout to write: the source's unless dp / zero_stage say otherwise."""
    lay = meta["layout"]
    if lay.get("tp_size", 1) != 1:
        raise CheckpointError(f"checkpoint {meta['tag']!r} was saved with tensor parallelism (tp "
                              f"{lay['tp_size']}); exporting to DeepSpeed supports tp 1 only: load it at "
                              "tp 1 in meshspeed, save, and export that")
    dtype = dtype_from_name(lay["compute_dtype"])
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise CheckpointError(f"checkpoint {meta['tag']!r} trained in {lay['compute_dtype']}; exporting "
                              "to DeepSpeed supports fp32, bf16 and fp16 runs")
    dp = lay["dp_size"] if dp is None else int(dp)
    stage = lay["zero_stage"] if zero_stage is None else int(zero_stage)
    if dp < 1 or stage not in (0, 1, 2, 3):
        raise CheckpointError(f"cannot export to DeepSpeed with dp {dp} and ZeRO stage {stage}: dp must "
                              "be at least 1 and the stage one of 0, 1, 2, 3")
    return Target(dp, stage, dtype, exclude_frozen)


# -- what the source holds --------------------------------------------------------------------
def _numel(meta: dict, name: str) -> int:
    return math.prod(meta["params"][name]["shape"])


def _step(meta: dict, name: str) -> int:
    saved = meta["params"][name].get("optimizer_scalars", {}).get("step")
    if saved is None:
        return 0
    return round(float(saved["value"] if isinstance(saved, dict) else saved))


def _ds_options(meta: dict, options: dict[str, Any]) -> dict[str, Any]:
    if meta["optimizer"]["class"] == "FusedAdam":
        out = {k: options[k] for k in FUSED_ADAM_OPTIONS if k in options}
        out.setdefault("bias_correction", True)
        out = {k: out[k] for k in FUSED_ADAM_OPTIONS if k in out}
        out["step"] = 0  # FusedAdam's group counter; the count that matters is per state
    else:
        out = dict(options)
    if "betas" in out:
        out["betas"] = tuple(out["betas"])
    return out


def groups_of(meta: dict) -> list[Group]:
    """The optimizer's param groups, keeping only parameters the optimizer updates."""
    out = []
    for i, g in enumerate(meta["optimizer"]["param_groups"]):
        names = [n for n in g["params"] if n in meta["params"] and meta["params"][n]["requires_grad"]]
        states: list[str] = []
        for n in names:
            for r in meta["params"][n]["ranges"]:
                states += [s for s in r["optimizer"] if s not in states]
        steps = {_step(meta, n) for n in names}
        if len(steps) > 1:
            raise CheckpointError(f"optimizer param group {i} of checkpoint {meta['tag']!r} has parameters "
                                  f"at different step counts {sorted(steps)}; DeepSpeed keeps one per group")
        out.append(Group(_ds_options(meta, g["options"]), [(n, _numel(meta, n)) for n in names],
                         states, steps.pop() if steps else 0))
    return out


def _scheduler_state(meta: dict) -> Any:
    state = meta["lr_scheduler"]
    kind = (meta.get("config", {}).get("scheduler") or {}).get("type")
    if isinstance(state, dict) and kind in DS_SCHEDULES and "last_batch_iteration" in state:
        return {"last_batch_iteration": state["last_batch_iteration"]}
    return state


def _client_state(store: SavedTensors) -> dict:
    meta = store.meta
    if meta.get("client_state") is None:
        return {}
    tensors = {k: store.read(CLIENT_TENSORS, k) for k in meta.get("client_tensors", [])}
    client = decode_client_state(meta["client_state"], tensors)
    if not isinstance(client, dict):
        raise CheckpointError(f"client_state of checkpoint {meta['tag']!r} is a {type(client).__name__}; "
                              "DeepSpeed's files keep the client state's keys at top level, so it must be a dict")
    return client


def _buffer(store: SavedTensors, name: str) -> torch.Tensor:
    meta = store.meta
    file = meta["buffers"][name].get("file") or next(r["file"] for r in meta["ranks"] if r["rank"] == 0)
    return store.read(file, f"buffer/{name}")


def _master(store: SavedTensors, name: str, start: int = 0, end: int | None = None) -> torch.Tensor:
    end = _numel(store.meta, name) if end is None else end
    out = torch.empty(end - start, dtype=torch.float32)
    store.fill(name, "master", start, end, out)
    return out


def _fill(store: SavedTensors, kind: str, part: layout.Partition) -> torch.Tensor:
    """A rank's flat buffer of `kind` ("master", "optim/exp_avg", ...): padding is zero."""
    flat = torch.zeros(part.numel, dtype=torch.float32)
    for p in part.pieces:
        store.fill(p.name, kind, p.start, p.end, flat[p.offset : p.offset + p.numel])
    return flat


# -- the model-states file --------------------------------------------------------------------
def _module(store: SavedTensors, target: Target, placeholders: bool) -> OrderedDict[str, torch.Tensor]:
    """The module's state_dict in the compute dtype (ZeRO 3: empty parameter placeholders)."""
    meta = store.meta
    aliases: dict[str, list[str]] = {}
    for alias, name in meta["aliases"].items():
        aliases.setdefault(name, []).append(alias)
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for name, p in meta["params"].items():
        if target.exclude_frozen and not p["requires_grad"]:
            continue
        t = (torch.empty(0, dtype=target.dtype) if placeholders
             else _master(store, name).view(p["shape"]).to(target.dtype))
        for n in [name, *aliases.get(name, [])]:
            out[n] = t
    for name in meta["buffers"]:
        out[name] = _buffer(store, name)
    return out


def _frozen(store: SavedTensors, target: Target, rank: int) -> tuple[Any, Any]:
    """(frozen_param_shapes, frozen_param_fragments): kept from stage 2 on, as DeepSpeed does."""
    if target.stage < 2 or target.exclude_frozen:
        return None, None
    meta = store.meta
    shapes, fragments = OrderedDict(), OrderedDict()
    for name, p in meta["params"].items():
        if p["requires_grad"]:
            continue
        shapes[name] = torch.Size(p["shape"])
        if target.stage == 3:
            part = layout.param_partition([(name, _numel(meta, name))], target.dp, rank)
            fragments[name] = _fill(store, "master", part).to(target.dtype)
        else:
            fragments[name] = _master(store, name).view(p["shape"]).to(target.dtype)
    return shapes, fragments


def _param_shapes(meta: dict, target: Target, groups: list[Group]) -> list[dict]:
    out = []
    for g in groups:
        for sub in (_sub_groups(meta, target, g) if target.stage == 3 else [g.params]):
            out.append(OrderedDict((n, torch.Size(meta["params"][n]["shape"])) for n, _ in sub))
    return out


def _sub_groups(meta: dict, target: Target, g: Group) -> list[list[tuple[str, int]]]:
    zero = meta.get("config", {}).get("zero_optimization") or {}
    return layout.sub_groups(g.params, target.dp, zero.get("sub_group_size", DEFAULT_SUB_GROUP_SIZE))


def model_states(store: SavedTensors, target: Target, groups: list[Group], rank: int,
                 client: dict, optimizer: Any) -> dict:
    """DeepSpeed's model-states dict (keys in DeepSpeed's order; client_state keys last)."""
    meta = store.meta
    zero = target.stage > 0
    shapes, fragments = _frozen(store, target, rank)
    counters = meta["counters"]
    state = {
        "module": _module(store, target, placeholders=target.stage == 3),
        "buffer_names": list(meta["buffers"]),
        "optimizer": None if zero else optimizer,
        "param_shapes": _param_shapes(meta, target, groups) if zero else None,
        "frozen_param_shapes": shapes,
        "shared_params": dict(meta["aliases"]) if zero else None,
        "frozen_param_fragments": fragments,
        "lr_scheduler": _scheduler_state(meta),
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": counters["skipped_steps"],
        "global_steps": counters["global_steps"],
        "global_samples": counters["global_samples"],
        "dp_world_size": target.dp,
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": meta.get("config"),
        "ds_version": DS_VERSION,
    }
    clash = sorted(set(client) & set(state))
    if clash:
        raise CheckpointError(f"client_state of checkpoint {meta['tag']!r} has key(s) {clash} that "
                              "DeepSpeed's model-states file uses itself; rename them to export")
    state.update(client)
    return state


# -- optimizer state --------------------------------------------------------------------------
def stage0_optimizer(store: SavedTensors, target: Target, groups: list[Group]) -> dict:
    """Stage 0: fp32 -> the base optimizer's own state_dict; bf16/fp16 -> DeepSpeed's
    mixed-precision wrapper around it (flat fp32 groups; fp16 adds the loss scale)."""
    meta = store.meta
    fused = meta["optimizer"]["class"] == "FusedAdam"
    state, param_groups, flats, index = {}, [], [], 0
    for g in groups:
        if target.mixed:
            part = layout.param_partition(g.params, 1, 0)
            entry = {s: _fill(store, f"optim/{s}", part) for s in g.states}
            state[index] = {**entry, "step": g.step}
            flats.append(_fill(store, "master", part))
            param_groups.append({**g.options, "params": [index]})
            index += 1
            continue
        ids = []
        for k, (name, numel) in enumerate(g.params):
            part = layout.param_partition([(name, numel)], 1, 0)
            shape = meta["params"][name]["shape"]
            entry = {s: _fill(store, f"optim/{s}", part).view(shape) for s in g.states}
            # Note [what DeepSpeed's optimizer expects of the step]
            step = g.step if (not fused or k == len(g.params) - 1) else 0
            state[index] = {**entry, "step": step} if fused else {"step": torch.tensor(float(step)), **entry}
            ids.append(index)
            index += 1
        param_groups.append({**g.options, "params": ids})
    base = {"state": state, "param_groups": param_groups}
    if not target.mixed:
        return base
    scale = scaler.stage0_keys(meta) if target.dtype == torch.float16 else {}  # Note [DeepSpeed's loss-scale counters]
    return {**scale, "optimizer_state_dict": base, "fp32_groups_flat": flats, "clip_grad": _clip(meta)}


def _clip(meta: dict) -> float:
    return float(meta.get("config", {}).get("gradient_clipping") or 0.0)


def zero12_optimizer(store: SavedTensors, target: Target, groups: list[Group], rank: int) -> dict:
    """Stage 1/2: rank `rank`'s flat partition of every group (Note [DeepSpeed's flat partitions])."""
    state, param_groups, masters, paddings, mappings = {}, [], [], [], []
    for i, g in enumerate(groups):
        part = layout.flat_partitions(g.params, target.dp)[rank]
        state[i] = {**{s: _fill(store, f"optim/{s}", part) for s in g.states}, "step": g.step}
        param_groups.append({**g.options, "params": [i]})
        master = _fill(store, "master", part)
        masters.append(master[: part.numel - part.padding].clone())  # not the padded storage
        paddings.append(part.padding)
        mappings.append(OrderedDict((p.name, picklewriter.fragment_address(p.numel, p.offset))
                                    for p in part.pieces))
    return {
        "loss_scaler": scaler.record(store.meta),
        "dynamic_loss_scale": scaler.is_dynamic(store.meta),
        "overflow": False,
        "clip_grad": _clip(store.meta),
        "base_optimizer_state": {"state": state, "param_groups": param_groups},
        "single_partition_of_fp32_groups": masters,
        "zero_stage": picklewriter.zero_stage(target.stage),
        "group_paddings": paddings,
        "param_alignment_paddings": [[0] * len(g.params) for g in groups],
        "partition_count": [target.dp] * len(groups),
        "ds_version": DS_VERSION,
        "param_slice_mappings": mappings,
    }


def zero3_optimizer(store: SavedTensors, target: Target, groups: list[Group], rank: int) -> dict:
    """Stage 3: rank `rank`'s piece of every parameter, one flat buffer per sub-group."""
    state, param_groups, flats, index = {}, [], [], 0
    for g in groups:
        ids = []
        for sub in _sub_groups(store.meta, target, g):
            part = layout.param_partition(sub, target.dp, rank)
            state[index] = {**{s: _fill(store, f"optim/{s}", part) for s in g.states}, "step": g.step}
            flats.append(_fill(store, "master", part))
            ids.append(index)
            index += 1
        param_groups.append({**g.options, "params": ids})
    return {
        "zero_stage": picklewriter.zero_stage(3),
        "loss_scaler": scaler.record(store.meta),
        "dynamic_loss_scale": scaler.is_dynamic(store.meta),
        "overflow": False,
        "partition_count": target.dp,
        "optimizer_state_dict": {"state": state, "param_groups": param_groups},
        "fp32_flat_groups": flats,
    }


# -- writing ----------------------------------------------------------------------------------
def write_files(store: SavedTensors, dest: str, target: Target) -> list[str]:
    """Write DeepSpeed's .pt files of `target` into the existing directory `dest`; one file
    at a time, each atomically. Returns the file names, in the order written."""
    meta = store.meta
    groups = groups_of(meta)
    client = _client_state(store)
    written = []

    def put(name: str, obj: Any) -> None:
        picklewriter.save(obj, os.path.join(dest, name))
        written.append(name)

    if target.stage in (1, 2, 3):
        for r in range(target.dp):
            build = zero3_optimizer if target.stage == 3 else zero12_optimizer
            put(layout.optim_states_name(r, target.bf16),
                {"optimizer_state_dict": build(store, target, groups, r),
                 "ds_config": meta.get("config"), "ds_version": DS_VERSION})
    optimizer = stage0_optimizer(store, target, groups) if target.stage == 0 else None
    for r in range(target.dp if target.stage == 3 else 1):
        put(layout.model_states_name(target.stage, r), model_states(store, target, groups, r, client, optimizer))
    return written


def open_checkpoint(ckpt_dir, tag: str | None = None, verify: bool = True) -> SavedTensors:
    path = resolve(ckpt_dir, tag)
    meta = read_meta(path)
    if verify:
        verify_files(path, meta)
    return SavedTensors(path, meta)


def export(ckpt_dir, out_dir, tag: str | None = None, out_tag: str | None = None, dp: int | None = None,
           zero_stage: int | None = None, verify: bool = True, save_latest: bool = True) -> dict:
    """Write `<out_dir>/<tag>/` in DeepSpeed 0.19.8's layout (dp and ZeRO stage: the source's
    unless given), then `<out_dir>/latest`. All or nothing: the files are written into a
    temporary directory that is renamed into place complete, and `latest` comes last."""
    store = open_checkpoint(ckpt_dir, tag, verify)
    target = target_for(store.meta, dp, zero_stage)
    out_tag = check_tag(out_tag or store.meta["tag"])
    out_dir = os.fspath(out_dir)
    tmp = prepare(out_dir, out_tag)
    try:
        files = write_files(store, tmp, target)
        final = os.path.join(out_dir, out_tag)
        publish_dir(tmp, final)
    except BaseException:
        remove_tree(tmp)
        raise
    if save_latest:
        write_text(os.path.join(out_dir, layout.LATEST), out_tag)
    return {"source": store.path, "output": final, "tag": out_tag, "dp": target.dp,
            "zero_stage": target.stage, "dtype": str(target.dtype).replace("torch.", ""), "files": files}
