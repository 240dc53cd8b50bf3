"""`load_checkpoint`: each rank reads the ranges it owns in the current layout.

Steps (collective; a failure on any rank raises on all): finish a save in flight; find
the tag and read meta.json; check every file's size and SHA-256 (shared among ranks);
check the model matches (logical shapes); read each owned master range (Note [resharding
is range intersection] in reshard.py; under tensor parallelism Note [tensor-parallel
ranges] in tp_ranges.py) and let the strategy rebuild the parameters; then optimizer
state the same way, LR schedule, loss scale, counters, data position and RNG.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from meshspeed import comm
from meshspeed.checkpoint import pending
from meshspeed.checkpoint.agree import everywhere, rank0_path, same_everywhere
from meshspeed.checkpoint.deepspeed_format.discover import find_tag
from meshspeed.checkpoint.deepspeed_format.engine_load import load_deepspeed
from meshspeed.checkpoint.deepspeed_format.universal import check_universal, universal_tag
from meshspeed.checkpoint.errors import CheckpointError
from meshspeed.checkpoint.fetch import (
    fetch_missing,
    files_needed,
    is_node_local,
    open_on_every_host,
    verify_local,
)
from meshspeed.checkpoint.hosts import Placement, gather_placement
from meshspeed.checkpoint.jsonable import decode_client_state, restore_rng
from meshspeed.checkpoint.metadata import dtype_from_name, read_meta
from meshspeed.checkpoint.paths import CLIENT_TENSORS, META, resolve
from meshspeed.checkpoint.reshard import ReadPlan, SavedTensors, verify_files
from meshspeed.checkpoint.resize import micro_steps_at
from meshspeed.checkpoint.resume import resume_tag
from meshspeed.checkpoint.snapshot import ordered_slices, persistent_buffers, tp_layout
from meshspeed.checkpoint.tp_ranges import logical_shape
from meshspeed.parallel.protocol import RankState, declares
from meshspeed.process.progress import progress

log = logging.getLogger("meshspeed")


def _open(load_dir, tag) -> tuple[str, dict]:
    path = resolve(load_dir, tag)
    return path, read_meta(path)


def _verify(path: str, meta: dict, placement: Placement | None) -> None:
    if placement is None:
        verify_files(path, meta, comm.get_rank(), comm.get_world_size())
    else:  # Note [checkpoints on node-local disks] (hosts.py)
        verify_local(path, meta, placement, comm.get_rank())


def match_model(path: str, meta: dict, slices, strict: bool, model_names: set[str] | None = None) -> list:
    """The slices to load; a one-line error for the first parameter that does not fit.
    `model_names`: every parameter name of the whole model, when this rank holds only some
    of them (a pipeline stage); by default this rank's slices'."""
    saved = meta["params"]
    for s in slices:  # logical (whole) shapes on both sides, whatever the tensor parallelism
        if s.name in saved and tuple(saved[s.name]["shape"]) != logical_shape(s):
            raise CheckpointError(
                f"checkpoint {path} does not fit this model: parameter {s.name!r} has shape "
                f"{tuple(saved[s.name]['shape'])} in the checkpoint but {logical_shape(s)} in the model")
    missing = [s.name for s in slices if s.name not in saved]
    known = model_names if model_names is not None else {s.name for s in slices}
    unexpected = [n for n in saved if n not in known]
    if strict and (missing or unexpected):
        which = (f"parameter {missing[0]!r} of the model is not in the checkpoint" if missing
                 else f"checkpoint parameter {unexpected[0]!r} is not in the model")
        raise CheckpointError(f"checkpoint {path} does not fit this model: {which} "
                              f"({len(missing)} missing, {len(unexpected)} unexpected); pass "
                              "load_module_strict=False to load the parameters that match")
    if (missing or unexpected) and comm.get_rank() == 0:
        log.warning("loading %s non-strictly: %d model parameter(s) not in the checkpoint keep "
                    "their values (first: %s); %d checkpoint parameter(s) ignored", path,
                    len(missing), missing[:1], len(unexpected))
    return [s for s in slices if s.name in saved]


def plan_reads(store: SavedTensors, slices) -> dict[str, ReadPlan]:
    """Per slice, what to read from which saved range (shared by master and optimizer state)."""
    return {s.name: store.plan(s.name, s.start, s.end, s.tp) for s in slices}


def _load_weights(engine, store: SavedTensors, slices, plans: dict[str, ReadPlan]) -> None:
    with torch.no_grad(), progress(len(slices), "checkpoint load", unit="tensor") as bar:
        for s in slices:
            bar.update()
            if s.swap is None:
                store.fill_planned(plans[s.name], "master", s.master)
                continue
            values = s.swap.read()  # masters in swap files: one range in memory at a time
            store.fill_planned(plans[s.name], "master", values)
            s.swap.write(values)
        buffers = persistent_buffers(engine.module)
        rank0_file = next(r["file"] for r in store.meta["ranks"] if r["rank"] == 0)
        for name, info in store.meta["buffers"].items():
            if name not in buffers:
                continue
            if tuple(info["shape"]) != tuple(buffers[name].shape):
                raise CheckpointError(
                    f"checkpoint {store.path} does not fit this model: buffer {name!r} has shape "
                    f"{tuple(info['shape'])} in the checkpoint but {tuple(buffers[name].shape)} in the model")
            buffers[name].copy_(store.read(info.get("file", rank0_file), f"buffer/{name}"))


# torch's Adam and AdamW and DeepSpeed's FusedAdam and DeepSpeedCPUAdam keep the same state
# (step, exp_avg, exp_avg_sq) and options (decoupled_weight_decay says which update), so a
# checkpoint of one loads into another: a config's "Adam" builds FusedAdam, a script torch's.
_ADAM_FAMILY = frozenset({"Adam", "AdamW", "FusedAdam", "DeepSpeedCPUAdam"})


def _family(class_name: str) -> str:
    return "Adam" if class_name in _ADAM_FAMILY else class_name


def _restore_groups(optimizer, meta: dict, path: str) -> None:
    saved = meta["optimizer"]
    if _family(saved["class"]) != _family(type(optimizer).__name__):
        raise CheckpointError(f"checkpoint {path} holds {saved['class']} state but the engine's "
                              f"optimizer is {type(optimizer).__name__}; pass "
                              "load_optimizer_states=False to load the weights only")
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(f"checkpoint {path} has {len(saved['param_groups'])} optimizer param "
                              f"group(s), the engine's optimizer {len(optimizer.param_groups)}; "
                              "pass load_optimizer_states=False to load the weights only")
    for group, g in zip(optimizer.param_groups, saved["param_groups"]):
        for k, v in g["options"].items():
            if k in group:
                group[k] = tuple(v) if isinstance(group[k], tuple) else v


def _scalar(saved: dict[str, Any], device: torch.device) -> Any:
    if "dtype" not in saved:
        return saved["value"]
    t = torch.tensor(saved["value"], dtype=dtype_from_name(saved["dtype"])).reshape(saved["shape"])
    return t.to(device) if saved.get("on_device") else t


def _load_optimizer(engine, store: SavedTensors, slices, plans: dict[str, ReadPlan], path: str) -> None:
    opt = engine.optimizer
    _restore_groups(opt, store.meta, path)
    tracked = {id(p) for g in opt.param_groups for p in g["params"]}
    for s in slices:
        entry = store.meta["params"][s.name]
        if id(s.key) not in tracked or "optimizer_scalars" not in entry:
            continue  # frozen now, or never stepped when saved
        keys = entry["ranges"][0]["optimizer"]
        if any(set(r["optimizer"]) != set(keys) for r in plans[s.name].ranges):
            raise CheckpointError(f"checkpoint {path}: optimizer state of {s.name!r} differs "
                                  "between ranks; pass load_optimizer_states=False")
        state: dict[str, Any] = {k: _scalar(v, s.key.device)
                                 for k, v in entry["optimizer_scalars"].items()}
        for k in keys:
            t = torch.empty(s.key.shape, dtype=store.saved_dtype(s.name, f"optim/{k}", plans[s.name], s.key.dtype),
                            device=s.key.device)
            store.fill_planned(plans[s.name], f"optim/{k}", t)
            state[k] = t
        opt.state[s.key] = state


def _load_loop_state(engine, meta: dict, store: SavedTensors, load_scheduler: bool,
                     load_optimizer: bool) -> None:
    saved_scaler, scaler = meta["loss_scaler"], engine.loss_scaler.state_dict()
    if load_optimizer and saved_scaler and scaler:
        if set(saved_scaler) == set(scaler):
            engine.loss_scaler.load_state_dict(saved_scaler)
        elif comm.get_rank() == 0:
            log.warning("not loading the saved loss scaler state %s: this run scales "
                        "differently (%s)", saved_scaler, scaler)
    if load_scheduler and engine.lr_scheduler is not None and meta["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    c = meta["counters"]
    engine.global_steps = c["global_steps"]
    engine.micro_steps = micro_steps_at(c["micro_steps"], meta["data"],
                                        engine.config.gradient_accumulation_steps)
    engine.global_samples, engine.skipped_steps = c["global_samples"], c["skipped_steps"]
    _load_data_position(engine, meta["data"])
    mine = [r for r in meta["ranks"] if r["rank"] == comm.get_rank()]
    # a new rank keeps its RNG state; an imported DeepSpeed checkpoint has none
    if mine and mine[0].get("rng") is not None and engine.config.checkpoint.load_rng_state:
        restore_rng(mine[0]["rng"], lambda key: store.read(mine[0]["file"], key))
    _load_rank_state(engine, meta, store, mine[0] if mine else None)


def _load_data_position(engine, data: dict) -> None:
    """The engine's loader continues where the saved run's was (Note [resuming the data
    order]); at another data-parallel size or micro-batch size its batches are other
    samples, so only the sampler's epoch is restored."""
    loader = engine.training_dataloader
    sampler = getattr(loader, "sampler", None)
    position = data.get("loader")
    same_batches = (data.get("dp_size") == engine.topology.size("dp")
                    and data.get("micro_batch_size") == engine.config.train_micro_batch_size_per_gpu)
    # Note [the data order across a resize]: a position in global samples fits any size
    same_batches = same_batches or (position is not None and "samples" in position)
    if position is not None and same_batches and callable(getattr(loader, "load_state_dict", None)):
        loader.load_state_dict(position)
        return
    if position is not None and position["batches"] and loader is not None and comm.get_rank() == 0:
        log.warning("the checkpoint's data loader had read %d batches of epoch %d at data-parallel "
                    "size %s, micro-batch %s; at this run's sizes (%d, %d) those are other samples, so "
                    "the loader starts the epoch from its beginning", position["batches"],
                    position["epoch"], data.get("dp_size"), data.get("micro_batch_size"),
                    engine.topology.size("dp"), engine.config.train_micro_batch_size_per_gpu)
    epoch = data.get("sampler_epoch")
    if epoch is not None and hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)


# Note [rank-local state]
# Some state belongs to one rank and is not a slice of any parameter: the error-feedback
# residuals of `gradient_compression` (what this rank's compression has not sent yet).
# A strategy that has such state gives it as `rank_state()` ({key: tensor}); each rank
# saves its own in its file, and on load at the same world size each rank reads its own
# back (`load_rank_state(state, steps)`, with the loaded step count). At another world size
# the residuals belong to a layout that no longer exists: the strategy restarts them at
# zero and rank 0 says so. (1-bit Adam's error buffers restart at zero on load, as in
# DeepSpeed: optim/onebit.py.)
def _load_rank_state(engine, meta: dict, store: SavedTensors, mine: dict | None) -> None:
    if not declares(engine.strategy, RankState):
        return
    same_world = meta["layout"]["world_size"] == comm.get_world_size()
    keys = mine.get("rank_state", []) if mine is not None and same_world else []
    engine.strategy.load_rank_state({k: store.read(mine["file"], f"rank_state/{k}") for k in keys},
                                    engine.global_steps)


def _client_state(meta: dict, store: SavedTensors) -> Any:
    if meta["client_state"] is None:
        return {}  # as DeepSpeed: the client state is a dict, empty when none was saved
    tensors = {k: store.read(CLIENT_TENSORS, k) for k in meta["client_tensors"]}
    return decode_client_state(meta["client_state"], tensors)


def _same_kind(deepspeed_tag, load_dir) -> None:
    if deepspeed_tag is None:
        raise CheckpointError(f"{load_dir} is a DeepSpeed checkpoint on other ranks but not on this "
                              "one; the checkpoint must be on a file system every rank shares")


def load_checkpoint(engine, load_dir, tag=None, load_module_strict: bool = True,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False) -> tuple[str, Any]:
    """Load a checkpoint saved at any data-parallel size and ZeRO stage.

    Collective. Returns `(checkpoint directory, client_state)`; errors (missing directory or
    tag, corrupted file, different model) are raised as one-line CheckpointErrors. With
    `checkpoint.auto_resume` and no tag, loads the newest complete checkpoint and returns
    `(None, None)` when there is none yet (Note [what auto_resume loads], resume.py)."""
    pending.wait_for_pending(engine)
    # Note [ranks that name different checkpoint directories] (agree.py)
    load_dir = rank0_path("checkpoint load directory", os.fspath(load_dir))
    # a DeepSpeed checkpoint (its `latest` or tag holds mp_rank_*_model_states.pt): converted,
    # then loaded by this function (Note [importing through meshspeed's format])
    universal = engine.config.checkpoint.load_universal  # Note [checkpoint.load_universal]
    if universal:
        tag = everywhere(universal_tag, load_dir, tag)
    deepspeed_tag = everywhere(find_tag, load_dir, tag)
    if universal:
        everywhere(check_universal, deepspeed_tag)
    if any(comm.all_gather_object(deepspeed_tag is not None)):
        everywhere(_same_kind, deepspeed_tag, load_dir)
        return load_deepspeed(engine, deepspeed_tag, load_checkpoint, load_module_strict=load_module_strict,
                              load_optimizer_states=load_optimizer_states,
                              load_lr_scheduler_states=load_lr_scheduler_states,
                              load_module_only=load_module_only)
    if tag is None and engine.config.checkpoint.auto_resume and not os.path.isfile(
            os.path.join(os.fspath(load_dir), META)):
        # Note [what auto_resume loads]
        tag = resume_tag(load_dir, engine.config.checkpoint.use_node_local_storage)
        if tag is None:
            return None, None  # a first run: nothing to resume (DeepSpeed's return)
    path, meta = open_on_every_host(_open, load_dir, tag)
    same_everywhere("checkpoint to load", os.path.abspath(path))
    placement = gather_placement() if any(comm.all_gather_object(is_node_local(meta))) else None
    everywhere(_verify, path, meta, placement)
    slices = everywhere(ordered_slices, engine)
    names = None
    # Note [a checkpoint of pipeline stages]; each ep rank holds other experts (named by
    # their global expert id, meshspeed/parallel/experts.py)
    if engine.topology.size("pp") > 1 or engine.topology.size("ep") > 1:
        names = {n for part in comm.all_gather_object([s.name for s in slices]) for n in part}
    slices = everywhere(match_model, path, meta, slices, load_module_strict, names)
    store = SavedTensors(path, meta)
    plans = everywhere(plan_reads, store, slices)
    if placement is not None:  # Note [fetching a node-local checkpoint's files] (fetch.py)
        fetch_missing(path, meta, everywhere(files_needed, meta, plans, comm.get_rank()), placement)
    everywhere(_load_weights, engine, store, slices, plans)
    engine.strategy.sync_params_from_masters()
    if not load_module_only:
        if load_optimizer_states:
            everywhere(_load_optimizer, engine, store, slices, plans, path)
        everywhere(_load_loop_state, engine, meta, store, load_lr_scheduler_states,
                   load_optimizer_states)
    client_state = everywhere(_client_state, meta, store)
    if comm.get_rank() == 0:
        layout = meta["layout"]
        log.info("loaded %s (saved at tp=%d x dp=%d, ZeRO stage %d; now tp=%d x dp=%d, stage %d)",
                 path, layout.get("tp_size", 1), layout["dp_size"], layout["zero_stage"],
                 tp_layout(engine)[1], engine.topology.size("dp"), engine.config.zero_stage)
    return path, client_state

