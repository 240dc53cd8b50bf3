"""A DeepSpeed universal checkpoint (`python -m deepspeed.checkpoint.ds_to_universal` output).

    <tag>/mp_rank_00_model_states.pt      the engine state (counters, scheduler, client state)
    <tag>/zero/optimizer_state.pt          param groups (lr, betas ...), loss scaler, ZeRO stage
    <tag>/zero/<param>/fp32.pt             {"param": the whole fp32 master, "cat_dim": ...}
    <tag>/zero/<param>/exp_avg.pt, exp_avg_sq.pt   the Adam moments, whole, alike
    <tag>/zero/<param>/step.pt             the step count (a number or a 0-d tensor)

Every tensor is already whole (ds_to_universal joined the ZeRO partitions and the
tensor-parallel pieces), so reading is one file per parameter and state. The result offers
read.DeepSpeedCheckpoint's reading interface (to_meshspeed.py, consolidate.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch

from meshspeed.checkpoint.deepspeed_format.discover import TagFiles
from meshspeed.checkpoint.deepspeed_format.read import _ENGINE_KEYS, MOMENTS, ParamState
from meshspeed.checkpoint.deepspeed_format.unpickle import load_torch_file
from meshspeed.checkpoint.errors import CheckpointError

ZERO_DIR = "zero"


def is_universal(path: str) -> bool:
    """Whether the tag directory `path` is a universal checkpoint (it has zero/<param>/fp32.pt)."""
    root = os.path.join(path, ZERO_DIR)
    return os.path.isdir(root) and any(os.path.isfile(os.path.join(root, d, "fp32.pt")) for d in os.listdir(root))


class UniversalCheckpoint:
    """The tag's names, shapes and engine state now; each parameter's files when `params()`
    reaches it."""

    def __init__(self, files: TagFiles):
        self.files = files
        if (0, 0) not in files.model:
            raise CheckpointError(f"{files.path} is a DeepSpeed universal checkpoint without "
                                  "mp_rank_00_model_states.pt (ds_to_universal copies it there); "
                                  "the checkpoint is incomplete")
        self.header: dict[str, Any] = load_torch_file(files.model[(0, 0)])
        opt_path = os.path.join(files.path, ZERO_DIR, "optimizer_state.pt")
        self._opt: dict[str, Any] = load_torch_file(opt_path) if os.path.isfile(opt_path) else {}
        self.stage = int(self._opt.get("zero_stage", 0))
        self.dp_size = int(self.header.get("dp_world_size") or 1)
        root = os.path.join(files.path, ZERO_DIR)
        present = {d for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, "fp32.pt"))}
        # a pipeline's stages (or tensor-parallel ranks) each name their own parameters
        headers = [self.header] + [load_torch_file(f) for (dp, mp), f in sorted(files.model.items())
                                   if dp == 0 and mp > 0]
        self.group_names = _group_names(headers, present, files.path)
        named = {n for g in self.group_names for n in g}
        extra = sorted(present - named)
        if extra:
            raise CheckpointError(f"{os.path.join(root, extra[0])} is a parameter the model states file "
                                  f"{files.model[(0, 0)]} does not name; the files do not belong together")
        self.shapes = {n: tuple(self._read(n, "fp32").shape) for n in named}
        self.group_options = [{k: v for k, v in g.items() if k not in ("params", "step")}
                              for g in self._opt.get("param_groups") or []]
        module = self.header.get("module") or {}
        self.buffers = {n: module[n] for n in self.header.get("buffer_names") or [] if n in module}
        self.aliases = dict(self.header.get("shared_params") or {})
        scaler = self._opt.get("loss_scaler")
        self.loss_scaler = dict(scaler) if scaler is not None else None

    path = property(lambda self: self.files.path)
    lr_scheduler = property(lambda self: self.header.get("lr_scheduler"))
    config = property(lambda self: dict(self.header.get("ds_config") or {}))

    @property
    def counters(self) -> dict[str, int]:
        h = self.header
        return {k: int(h.get(k, 0) or 0) for k in ("global_steps", "global_samples", "skipped_steps")}

    @property
    def client_state(self) -> dict[str, Any]:
        return {k: v for k, v in self.header.items() if k not in _ENGINE_KEYS}

    @property
    def precision(self) -> str:
        for key in ("bf16", "fp16"):
            section = self.config.get(key)
            if isinstance(section, dict) and section.get("enabled"):
                return key
        return "fp32"

    @property
    def trainable(self) -> set[str]:
        return {n for g in self.group_names for n in g}

    def all_param_names(self) -> list[str]:
        return [n for g in self.group_names for n in g]

    def moment_keys(self, name: str) -> list[str]:
        return [k for k in MOMENTS if os.path.isfile(self._file(name, k))]

    def params(self) -> Iterator[ParamState]:
        for name in self.all_param_names():
            master = self._read(name, "fp32").float()
            moments = {k: self._read(name, k).float().reshape(master.shape) for k in self.moment_keys(name)}
            yield ParamState(name, master, moments, self._step(name))

    def _file(self, name: str, state: str) -> str:
        return os.path.join(self.files.path, ZERO_DIR, name, f"{state}.pt")

    def _read(self, name: str, state: str) -> torch.Tensor:
        path = self._file(name, state)
        sd = load_torch_file(path)
        t = sd.get("param") if isinstance(sd, dict) else sd
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{path} holds no tensor under 'param', which a universal "
                                  "checkpoint's state file has")
        return t

    def _step(self, name: str) -> int | None:
        path = self._file(name, "step")
        if not os.path.isfile(path):
            return None
        s = load_torch_file(path)
        if isinstance(s, dict):
            s = s.get("param")
        if isinstance(s, torch.Tensor):
            s = s.item()
        if not isinstance(s, (int, float)):
            raise CheckpointError(f"{path} holds {type(s).__name__}, not a step count")
        return int(s)


def _group_names(headers: list[dict[str, Any]], present: set[str], path: str) -> list[list[str]]:
    """The optimizer groups' parameter names in order: the model states files' `param_shapes`
    (one dict per group; every model-parallel rank's, each name once), else the first
    file's module keys."""
    groups: list[list[str]] = []
    seen: set[str] = set()
    for header in headers:
        for g, shapes in enumerate(header.get("param_shapes") or []):
            if g == len(groups):
                groups.append([])
            groups[g] += [n for n in shapes if n not in seen]
            seen.update(shapes)
    if not groups:
        header = headers[0]
        buffers = set(header.get("buffer_names") or [])
        groups = [[n for n in (header.get("module") or {}) if n not in buffers and n in present]]
    missing = [n for g in groups for n in g if n not in present]
    if missing:
        raise CheckpointError(f"{os.path.join(path, ZERO_DIR, missing[0])}/fp32.pt is missing; the "
                              "universal checkpoint is incomplete")
    return groups


def read_universal(files: TagFiles) -> UniversalCheckpoint:
    return UniversalCheckpoint(files)


LATEST_UNIVERSAL = "latest_universal"


# Note [checkpoint.load_universal]
# In DeepSpeed the key says the checkpoint to load is universal: with no tag, the tag is
# read from `<dir>/latest_universal` (which the user writes beside ds_to_universal's
# output), and the weights and optimizer state come from `zero/`. meshspeed does the same:
# the key picks `latest_universal` when there is one, and a DeepSpeed tag that is not
# universal is an error naming the key (DeepSpeed would fail on it too). meshspeed's own
# checkpoints load at any layout already, so with the key set they load as usual, from
# `latest`. Without the key a universal tag is recognised by its files and loaded all the
# same (DeepSpeed would need the key; loading it here cannot give other numbers).
def universal_tag(load_dir: str, tag: str | None) -> str | None:
    """The tag `load_checkpoint` reads with checkpoint.load_universal: `tag`, else the
    one `<load_dir>/latest_universal` names, else None (meshspeed's `latest`)."""
    if tag is not None:
        return tag
    path = os.path.join(os.fspath(load_dir), LATEST_UNIVERSAL)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        named = f.read().strip()
    if not named or "/" in named or named in (".", ".."):
        raise CheckpointError(f"{path} names no tag ({named!r}); write the universal tag's directory name there")
    return named


def check_universal(found: TagFiles | None) -> None:
    """checkpoint.load_universal is set: a DeepSpeed tag must be a universal one."""
    if found is not None and not found.universal:
        raise CheckpointError(f"checkpoint.load_universal is true but {found.path} is a DeepSpeed checkpoint "
                              "of per-rank files, not a universal one (zero/<param>/fp32.pt); convert it with "
                              "`python -m deepspeed.checkpoint.ds_to_universal`, or set "
                              "checkpoint.load_universal false: meshspeed loads it at any layout as it is")
