"""A DeepSpeed checkpoint tag, read into whole per-parameter tensors.

    ckpt = read_tag(find_tag(load_dir, tag))
    for p in ckpt.params():           # one parameter at a time, in named_parameters() order
        p.name, p.master, p.moments["exp_avg"], p.step
    ckpt.buffers, ckpt.lr_scheduler, ckpt.counters, ckpt.loss_scaler, ckpt.client_state

Every file goes through the allowlisting unpickler (unpickle.py) and is memory-mapped, so
`params()` reads each parameter's elements from the partitions that hold them and keeps
only the parameter it is producing (Note [where DeepSpeed keeps a parameter]).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from meshspeed.checkpoint.deepspeed_format.discover import TagFiles
from meshspeed.checkpoint.deepspeed_format.unpickle import load_torch_file
from meshspeed.checkpoint.errors import CheckpointError

MOMENTS = ("exp_avg", "exp_avg_sq")

# what a model-states file holds besides the client state (DeepSpeed 0.19's keys)
_ENGINE_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
    "checkpoint_parallel_dimensions", "ds_config", "ds_version", "csr_tensor_module_names",
    "universal_checkpoint_info",  # AutoTP: how the tensor-parallel pieces join (tp.py)
})


@dataclass
class ParamState:
    name: str
    master: torch.Tensor  # fp32, the parameter's whole shape
    moments: dict[str, torch.Tensor]  # exp_avg, exp_avg_sq as saved (fp32), whole shape
    step: int | None  # None: no optimizer state (frozen, or no optimizer saved)


@dataclass
class DeepSpeedCheckpoint:
    files: TagFiles
    stage: int
    dp_size: int
    header: dict[str, Any]  # dp rank 0's model-states file
    names: list[str]  # trainable parameters in optimizer order (= named_parameters order)
    shapes: dict[str, tuple[int, ...]]
    group_options: list[dict[str, Any]]  # per optimizer param group: lr, betas, eps, weight_decay ...
    group_names: list[list[str]]
    buffers: dict[str, torch.Tensor]
    loss_scaler: dict[str, Any] | None
    aliases: dict[str, str] = field(default_factory=dict)  # tied: alias -> saved name
    _optim: list[Any] = field(default_factory=list, repr=False)  # per dp rank, stage >= 1
    _models: list[Any] = field(default_factory=list, repr=False)  # per dp rank, stage 3
    _moment_keys: dict[str, list[str]] | None = field(default=None, repr=False)

    @property
    def path(self) -> str:
        return self.files.path

    @property
    def lr_scheduler(self) -> dict[str, Any] | None:
        return self.header.get("lr_scheduler")

    @property
    def counters(self) -> dict[str, int]:
        h = self.header
        return {"global_steps": int(h.get("global_steps", 0)), "global_samples": int(h.get("global_samples", 0)),
                "skipped_steps": int(h.get("skipped_steps", 0))}

    @property
    def client_state(self) -> dict[str, Any]:
        return {k: v for k, v in self.header.items() if k not in _ENGINE_KEYS}

    @property
    def config(self) -> dict[str, Any]:
        return dict(self.header.get("ds_config") or {})

    @property
    def precision(self) -> str:
        cfg = self.config
        for key in ("bf16", "fp16"):
            if isinstance(cfg.get(key), dict) and cfg[key].get("enabled"):
                return key
        return "fp32"

    @property
    def trainable(self) -> set[str]:
        return {n for g in self.group_names for n in g}

    def all_param_names(self) -> list[str]:
        """Every parameter in the order `params()` yields them."""
        return [n for g in self.group_names for n in g] + _frozen_names(self)

    def moment_keys(self, name: str) -> list[str]:
        """The optimizer state tensors saved for a parameter (exp_avg, exp_avg_sq, or none)."""
        if self._moment_keys is None:
            self._moment_keys = _moment_keys(self)
        return self._moment_keys.get(name, [])

    def params(self) -> Iterator[ParamState]:
        """Each trainable parameter, whole, then each frozen one (master only)."""
        if self.stage == 0:
            yield from _stage0_params(self)
        elif self.stage in (1, 2):
            yield from _zero12_params(self)
        else:
            yield from _zero3_params(self)
        module = self.header.get("module") or {}
        for name in _frozen_names(self):
            yield ParamState(name, module[name].float().clone(), {}, None)


class _Pieces:
    """Consecutive tensors read as one flat sequence, without concatenating them."""

    def __init__(self, tensors: list[torch.Tensor], where: str):
        self.tensors = [t.reshape(-1) for t in tensors]
        self.starts = [0]
        for t in self.tensors:
            self.starts.append(self.starts[-1] + t.numel())
        self.where = where

    @property
    def numel(self) -> int:
        return self.starts[-1]

    def take(self, start: int, n: int) -> torch.Tensor:
        """Elements [start, start + n) as a new fp32 tensor."""
        if start + n > self.numel:
            raise CheckpointError(f"{self.where} holds {self.numel} elements but the parameter shapes "
                                  f"need {start + n}; the checkpoint's files do not belong together")
        out = torch.empty(n, dtype=torch.float32)
        pos = 0
        for t, s in zip(self.tensors, self.starts):
            lo, hi = max(start, s), min(start + n, s + t.numel())
            if lo < hi:
                out[pos:pos + hi - lo] = t[lo - s:hi - s]
                pos += hi - lo
        return out


# Note [where DeepSpeed keeps a parameter]
# Stage 0: the optimizer's state_dict is in the model-states file; without a wrapper it is
# a torch one (state by parameter index, in param-group order) and the weights in `module`
# are the fp32 masters; with bf16/fp16 DeepSpeed's FP16_Optimizer keeps each group as one
# flat fp32 tensor (`fp32_groups_flat`) whose optimizer state is one flat tensor too.
# Stages 1 and 2: per param group, the group's parameters flattened in order and padded at
# the end to a multiple of dp; dp rank r saves its contiguous 1/dp of it
# (`single_partition_of_fp32_groups`, moments in `base_optimizer_state`); the names and
# shapes, in order, are the model-states file's `param_shapes`. Stage 3: every parameter is
# split on its own, each dp rank holding ceil(numel/dp) elements of it (the last ones
# padded), and a rank's sub-groups (`fp32_flat_groups`) concatenate its pieces in
# `param_shapes` order. FusedAdam (the config's "Adam") counts steps per group; its state
# holds the count in the last parameter it updated (Note [FusedAdam's step]).
def _stage0_params(ck: DeepSpeedCheckpoint) -> Iterator[ParamState]:
    opt = ck.header.get("optimizer")
    module = ck.header["module"]
    if not opt:
        for name in ck.names:
            yield ParamState(name, module[name].float().clone(), {}, None)
        return
    where = f"{ck.files.model[(0, 0)]} (its optimizer state)"
    if "fp32_groups_flat" in opt:
        inner = opt["optimizer_state_dict"]
        for g, names in enumerate(ck.group_names):
            state = inner["state"].get(g, {})
            flat = _Pieces([opt["fp32_groups_flat"][g]], where)
            moments = {k: _Pieces([state[k]], where) for k in MOMENTS if k in state}
            yield from _walk(names, ck.shapes, flat, moments, _step(state), lambda n, s: s)
        return
    state = opt["state"]
    step = _fused_step(opt, state)
    index = 0
    for names in ck.group_names:
        for name in names:
            st = state.get(index, {})
            index += 1
            moments = {k: st[k].float().reshape(ck.shapes[name]).clone() for k in MOMENTS if k in st}
            yield ParamState(name, module[name].float().clone(), moments,
                             step if st else None)


def _step(state: dict[str, Any]) -> int | None:
    s = state.get("step")
    if s is None:
        return None
    return int(s.item()) if isinstance(s, torch.Tensor) else int(s)


# Note [FusedAdam's step]
# DeepSpeed's FusedAdam (what "Adam" in a config builds) increments `state["step"]` of the
# last parameter of the group it updates and applies that count to the whole group: the
# other parameters' saved counts are stale (0 after two steps). The group's count is
# therefore the largest saved one. torch's Adam keeps real per-parameter counts, and
# taking the largest of equal counts changes nothing.
def _fused_step(opt: dict[str, Any], state: dict[int, Any]) -> int | None:
    steps = [_step(s) for s in state.values()]
    steps = [s for s in steps if s is not None]
    return max(steps) if steps else None


def _walk(names: list[str], shapes: dict[str, tuple[int, ...]], flat: _Pieces,
          moments: dict[str, _Pieces], step: int | None, offset_of) -> Iterator[ParamState]:
    """Parameters laid one after another in `flat` (and the moments alike)."""
    pos = 0
    for name in names:
        shape = shapes[name]
        n = math.prod(shape)
        master = flat.take(pos, n).reshape(shape)
        yield ParamState(name, master, {k: m.take(pos, n).reshape(shape) for k, m in moments.items()}, step)
        pos += n


def _zero12_params(ck: DeepSpeedCheckpoint) -> Iterator[ParamState]:
    for g, names in enumerate(ck.group_names):
        where = f"the optimizer states files of {ck.path} (param group {g})"
        sds = [f["optimizer_state_dict"] for f in ck._optim]
        flat = _Pieces([sd["single_partition_of_fp32_groups"][g] for sd in sds], where)
        states = [sd["base_optimizer_state"]["state"].get(g, {}) for sd in sds]
        moments = {k: _Pieces([s[k] for s in states], where) for k in MOMENTS if all(k in s for s in states)}
        steps = [_step(s) for s in states if _step(s) is not None]
        yield from _walk(names, ck.shapes, flat, moments, max(steps) if steps else None, None)


def _zero3_params(ck: DeepSpeedCheckpoint) -> Iterator[ParamState]:
    where = f"the optimizer states files of {ck.path}"
    flats, moments, steps = [], {k: [] for k in MOMENTS}, []
    for f in ck._optim:
        sd = f["optimizer_state_dict"]
        flats.append(_Pieces(list(sd["fp32_flat_groups"]), where))
        inner = sd["optimizer_state_dict"]["state"]
        for k in MOMENTS:
            moments[k].append(_Pieces([inner[i][k] for i in sorted(inner) if k in inner[i]], where))
        steps += [_step(inner[i]) for i in inner if _step(inner[i]) is not None]
    step = max(steps) if steps else None
    has = [k for k in MOMENTS if all(m.numel for m in moments[k])]
    pos = 0
    for name in ck.names:
        shape = ck.shapes[name]
        n = math.prod(shape)
        part = math.ceil(n / ck.dp_size)
        yield ParamState(name, _gather(flats, pos, part, shape),
                         {k: _gather(moments[k], pos, part, shape) for k in has}, step)
        pos += part


def _gather(rank_pieces: list[_Pieces], pos: int, part: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Stage 3: a parameter from every dp rank's `part` elements at `pos`, padding cut."""
    return torch.cat([p.take(pos, part) for p in rank_pieces])[:math.prod(shape)].reshape(shape)


def _moment_keys(ck: DeepSpeedCheckpoint) -> dict[str, list[str]]:
    def present(states: list[dict]) -> list[str]:
        return [k for k in MOMENTS if states and all(k in s for s in states)]

    if ck.stage == 0:
        opt = ck.header.get("optimizer")
        if not opt:
            return {}
        if "fp32_groups_flat" in opt:
            state = opt["optimizer_state_dict"]["state"]
            return {n: present([state.get(g, {})]) for g, names in enumerate(ck.group_names) for n in names}
        names = [n for g in ck.group_names for n in g]
        return {n: present([opt["state"].get(i, {})]) for i, n in enumerate(names)}
    sds = [f["optimizer_state_dict"] for f in ck._optim]
    if ck.stage in (1, 2):
        return {n: present([sd["base_optimizer_state"]["state"].get(g, {}) for sd in sds])
                for g, names in enumerate(ck.group_names) for n in names}
    subs = [st for sd in sds for st in sd["optimizer_state_dict"]["state"].values()]
    keys = present(subs)
    return {n: keys for n in ck.names}


def _frozen_names(ck: DeepSpeedCheckpoint) -> list[str]:
    frozen = ck.header.get("frozen_param_shapes") or {}
    if ck.stage == 3 and frozen:
        raise CheckpointError(f"{ck.path}: frozen parameters of a ZeRO-3 DeepSpeed checkpoint "
                              f"({next(iter(frozen))!r}, ...) are not read yet; unfreeze them before "
                              "saving, or convert with DeepSpeed's zero_to_fp32.py")
    trainable = ck.trainable
    return [n for n in frozen if n not in trainable]


def _module_param_names(header: dict[str, Any]) -> list[str]:
    """Parameter names of the saved module state dict: not buffers, not tied repeats."""
    buffers = set(header.get("buffer_names") or [])
    seen: set[tuple[int, int]] = set()
    names = []
    for name, t in (header.get("module") or {}).items():
        if name in buffers or not isinstance(t, torch.Tensor):
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen and t.numel() > 0:
            continue
        seen.add(key)
        names.append(name)
    return names


def _stage0_groups(header: dict[str, Any], names: list[str], shapes) -> list[list[str]]:
    """Stage 0: which parameters each optimizer group holds (the saved state dict lists
    indices only; parameters are in named_parameters() order, group after group)."""
    opt = header.get("optimizer")
    if not opt:
        return [names]
    if "fp32_groups_flat" in opt:
        sizes = [t.numel() for t in opt["fp32_groups_flat"]]
    else:
        counts = [len(g["params"]) for g in opt["param_groups"]]
        out, pos = [], 0
        for c in counts:
            out.append(names[pos:pos + c])
            pos += c
        return out
    out, pos = [], 0
    for size in sizes:
        group, total = [], 0
        while total < size and pos < len(names):
            group.append(names[pos])
            total += math.prod(shapes[names[pos]])
            pos += 1
        out.append(group)
    return out


def _group_options(header: dict[str, Any], optim: list[Any], stage: int) -> list[dict[str, Any]]:
    opt = header.get("optimizer") if stage == 0 else (optim[0]["optimizer_state_dict"] if optim else None)
    if not opt:
        return []
    if stage == 0:
        groups = (opt["optimizer_state_dict"] if "fp32_groups_flat" in opt else opt)["param_groups"]
    elif stage in (1, 2):
        groups = opt["base_optimizer_state"]["param_groups"]
    else:
        groups = opt["optimizer_state_dict"]["param_groups"]
    return [{k: v for k, v in g.items() if k not in ("params", "step")} for g in groups]


def _loss_scaler(header: dict[str, Any], optim: list[Any], stage: int) -> dict[str, Any] | None:
    """The saved loss-scaler attributes (DeepSpeed's names), or None in fp32/bf16 runs."""
    if stage == 0:
        opt = header.get("optimizer") or {}
        if "cur_scale" not in opt:
            return None
        return {"dynamic": bool(opt.get("dynamic_loss_scale")), **{k: opt[k] for k in (
            "cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window") if k in opt}}
    if not optim:
        return None
    scaler = optim[0]["optimizer_state_dict"].get("loss_scaler")
    return dict(scaler) if scaler is not None else None


def _zero_stage(header: dict[str, Any], files: TagFiles, optim: list[Any]) -> int:
    if optim:
        sd = optim[0]["optimizer_state_dict"]
        stage = int(sd.get("zero_stage", 0))
        # BF16_Optimizer (bf16 at stage 0 on accelerators) partitions like ZeRO 1 and writes
        # bf16_zero_pp_rank_* files; read its layout as stage 1's (not seen on CPU, where
        # DeepSpeed 0.19.8 uses FP16_Optimizer's flat groups instead)
        return max(stage, 1) if "single_partition_of_fp32_groups" in sd else stage
    stage = ((header.get("ds_config") or {}).get("zero_optimization") or {}).get("stage", 0)
    return int(stage)


def _refuse_other_kinds(files: TagFiles) -> None:
    if files.universal:
        raise CheckpointError(f"{files.path} is a DeepSpeed universal checkpoint; open it with "
                              "kinds.open_tag (universal.py reads it)")
    if files.layers:
        raise CheckpointError(f"{files.path} is a DeepSpeed pipeline checkpoint (layer_*-model_states.pt); "
                              "open it with kinds.open_tag (pipe.py reads it)")
    if files.tp_size > 1:
        raise CheckpointError(f"{files.path} is a DeepSpeed tensor-parallel checkpoint ({files.tp_size} "
                              "mp_rank files); open it with kinds.open_tag (tp.py reads it)")


def read_tag(files: TagFiles, tp_rank: int = 0, header: dict[str, Any] | None = None) -> DeepSpeedCheckpoint:
    """Open one model-parallel rank's files of a DeepSpeed tag directory (`mp_rank_<tp_rank>`):
    headers now, tensors lazily. `header`: that rank's model-states file, already read (a
    pipeline stage's, its `module` assembled from the layer files: pipe.py). Pipeline,
    tensor-parallel and universal checkpoints are opened by kinds.open_tag."""
    if header is None:
        _refuse_other_kinds(files)
    if (0, tp_rank) not in files.model:
        raise CheckpointError(f"{files.path} has no model states file for dp rank 0 "
                              f"(mp_rank_{tp_rank:02d}_model_states.pt); the checkpoint is incomplete")
    if header is None:
        header = load_torch_file(files.model[(0, tp_rank)])
    if not isinstance(header, dict) or "module" not in header:
        raise CheckpointError(f"{files.model[(0, tp_rank)]} is not a DeepSpeed model states file "
                              "(it has no 'module' entry)")
    # the saved dp size says how many optimizer files there must be (a missing one is named)
    dp = int(header.get("dp_world_size") or files.dp_size)
    optim = []
    for d in range(dp if files.optim else 0):
        if (d, tp_rank) not in files.optim:
            raise CheckpointError(f"{files.path} is missing dp rank {d}'s optimizer states file "
                                  f"(zero_pp_rank_{d}_mp_rank_{tp_rank:02d}_optim_states.pt); the "
                                  "checkpoint is incomplete")
        optim.append(load_torch_file(files.optim[(d, tp_rank)]))
    stage = _zero_stage(header, files, optim)
    if stage > 0 and not optim:
        raise CheckpointError(f"{files.path} was saved with ZeRO stage {stage} but holds no "
                              "*_optim_states.pt files; the checkpoint is incomplete")
    saved_dp = header.get("dp_world_size")
    if stage > 0 and saved_dp is not None and int(saved_dp) != dp:
        raise CheckpointError(f"{files.path} was saved at data-parallel size {saved_dp} but holds "
                              f"{dp} optimizer states files; the checkpoint is incomplete")
    models = []
    if stage == 3:
        models = [header] + [load_torch_file(files.model[(d, tp_rank)]) for d in range(1, dp)]
    if stage > 0:
        if not header.get("param_shapes"):
            raise CheckpointError(f"{files.model[(0, tp_rank)]} has no param_shapes, which a ZeRO "
                                  f"stage {stage} checkpoint needs to name its partitions")
        groups = [list(g) for g in header["param_shapes"]]
        shapes = {n: tuple(s) for g in header["param_shapes"] for n, s in g.items()}
        names = [n for g in groups for n in g]
    else:
        module = header["module"]
        frozen = set(header.get("frozen_param_shapes") or {})
        names = [n for n in _module_param_names(header) if n not in frozen]
        shapes = {n: tuple(module[n].shape) for n in names}
        groups = _stage0_groups(header, names, shapes)
        names = [n for g in groups for n in g]
    module = header.get("module") or {}
    shapes.update({n: tuple(s) for n, s in (header.get("frozen_param_shapes") or {}).items()})
    buffers = {n: module[n] for n in header.get("buffer_names") or [] if n in module}
    aliases = dict(header.get("shared_params") or {})
    return DeepSpeedCheckpoint(files, stage, dp if stage > 0 else int(saved_dp or 1), header, names, shapes,
                               _group_options(header, optim, stage), groups, buffers,
                               _loss_scaler(header, optim, stage), aliases, optim, models)
