"""Loading a checkpoint straight into a (tensor-parallel) model's local shards.

`load_into_shards(model, path)` fills every parameter of an already split model from
  * a meshspeed checkpoint directory (meta.json + per-rank safetensors files, or a save
    directory with `latest`): the fp32 masters, read range by range with the repo's
    resharding reader (Note [resharding is range intersection] in checkpoint/reshard.py);
  * a safetensors file, or a Hugging Face-style directory of *.safetensors files (with
    model.safetensors.index.json when sharded).

Note [reading only this rank's shard]
A split parameter carries a `TPShard` (topology/shards.py): pieces along one dim of
the logical tensor. Each piece is read on its own -- a safetensors `get_slice` of those
rows/columns, or a flat-range plan of the meshspeed checkpoint -- so a rank reads about
1/tp of the split weights plus the replicated ones (norms, biases of row layers, position
embeddings), never the whole model. `LoadStats.bytes_read` counts the bytes taken from
files so tests can assert it. For the same reason the SHA-256 sums in a meshspeed
checkpoint's meta.json are not checked here (hashing reads every file whole); sizes and
bounds are, by the tensor-file reader.
"""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from torch import nn

from meshspeed.checkpoint.errors import CheckpointError
from meshspeed.checkpoint.metadata import read_meta
from meshspeed.checkpoint.paths import LATEST, is_checkpoint, resolve
from meshspeed.checkpoint.reshard import SavedTensors
from meshspeed.checkpoint.tensorfile import TensorFile
from meshspeed.topology.shards import TPShard, shards_by_param

INDEX = "model.safetensors.index.json"


@dataclass
class LoadStats:
    bytes_read: int = 0  # bytes of tensor data read from files by this rank
    tensors: int = 0  # parameters and buffers filled
    skipped_buffers: list[str] = field(default_factory=list)  # checkpoint buffers not in the model


def load_into_shards(model: nn.Module, path: str) -> LoadStats:
    """Fill `model`'s parameters (whole or tensor-parallel local shards) from the checkpoint
    at `path`; raises CheckpointError naming the first parameter that does not fit."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path} does not exist; give a meshspeed checkpoint "
                              "directory, a .safetensors file or a directory of them")
    if os.path.isdir(path) and (is_checkpoint(path) or os.path.isfile(os.path.join(path, LATEST))):
        return _load_meshspeed(model, path)
    return _load_safetensors(model, path)


def _targets(model: nn.Module) -> dict[str, list[str]]:
    """Parameter name -> all names it goes by (a tied parameter has several), in order."""
    names: dict[int, list[str]] = {}
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        first.setdefault(id(p), name)
    return {first[k]: v for k, v in names.items()}


def _logical_shape(param: torch.Tensor, shard: TPShard | None) -> tuple[int, ...]:
    return tuple(shard.logical_shape) if shard is not None else tuple(param.shape)


def spellings(model: nn.Module, name: str) -> list[str]:
    """The names a checkpoint may use for the model's tensor `name`: itself, and for a
    Hugging Face model with a base model (GPT2LMHeadModel.transformer, LlamaForCausalLM.model)
    the name with that prefix dropped or added -- checkpoints of the base model (the hub's
    own `gpt2`) load into the model with a head, as `from_pretrained` allows."""
    base = getattr(model, "base_model_prefix", "")
    if not base or not isinstance(getattr(model, base, None), nn.Module):
        return [name]
    prefix = f"{base}."
    return [name, name[len(prefix):]] if name.startswith(prefix) else [name, prefix + name]


def _check_fit(where: str, model: nn.Module, saved_shapes: dict[str, tuple[int, ...]],
               aliases: dict[str, str]) -> dict[str, str]:
    """{model parameter name: its name in the checkpoint}; a one-sentence CheckpointError
    for a shape mismatch, or for missing / unexpected parameters."""
    params = dict(model.named_parameters())
    shards = shards_by_param(model)
    found: dict[str, str] = {}
    missing = []
    known: set[str] = set()  # every spelling of every model tensor
    for name, all_names in _targets(model).items():
        names = [aliases.get(s, s) for n in all_names for s in spellings(model, n)]
        known.update(names)
        saved = next((n for n in names if n in saved_shapes), None)
        if saved is None:
            missing.append(name)
            continue
        p = params[name]
        want = _logical_shape(p, shards.get(id(p)))
        if tuple(saved_shapes[saved]) != want:
            raise CheckpointError(
                f"checkpoint {where} is for another model: parameter {name!r} has shape "
                f"{tuple(saved_shapes[saved])} in the checkpoint but {want} in the model")
        found[name] = saved
    known.update(s for n, _ in model.named_buffers() for s in spellings(model, n))
    # transformers' list of checkpoint names its models ignore (old GPT-2 attention masks),
    # matched as whole trailing name components: GPT-2's "attn.bias" must not also hide
    # "h.2.attn.c_attn.bias" of a deeper model.
    ignore = [re.compile(rf"(?:^|\.)(?:{p})$")
              for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    unexpected = [n for n in saved_shapes
                  if n not in known and not any(p.search(n) for p in ignore)]
    if missing or unexpected:
        first = (f"parameter {missing[0]!r} of the model is not in it" if missing
                 else f"its tensor {unexpected[0]!r} is not a parameter of the model")
        raise CheckpointError(f"checkpoint {where} is for another model: {first} ({len(missing)} "
                              f"missing: {missing[:3]}, {len(unexpected)} unexpected: {unexpected[:3]})")
    return found


def _check_buffer(where: str, name: str, saved: tuple[int, ...], buf: torch.Tensor) -> None:
    if tuple(saved) != tuple(buf.shape):
        raise CheckpointError(f"checkpoint {where} is for another model: buffer {name!r} has shape "
                              f"{tuple(saved)} in the checkpoint but {tuple(buf.shape)} in the model")


# -- safetensors ------------------------------------------------------------------------------
def _safetensors_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        return sorted({os.path.join(path, v) for v in weight_map.values()})
    files = sorted(glob.glob(os.path.join(glob.escape(path), "*.safetensors")))
    if not files:
        raise CheckpointError(f"checkpoint directory {path} holds neither meta.json (a meshspeed "
                              "checkpoint) nor *.safetensors files")
    return files


def _load_safetensors(model: nn.Module, path: str) -> LoadStats:
    stats = LoadStats()
    handles = [safe_open(f, framework="pt") for f in _safetensors_files(path)]
    where: dict[str, object] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for h in handles:
        for key in h.keys():  # noqa: SIM118 - a safe_open handle is not iterable
            where[key] = h
            shapes[key] = tuple(h.get_slice(key).get_shape())
    found = _check_fit(path, model, shapes, {})
    params = dict(model.named_parameters())
    shards = shards_by_param(model)
    with torch.no_grad():
        for name, saved in found.items():
            p = params[name]
            _fill_from_slice(p, shards.get(id(p)), where[saved].get_slice(saved), stats)
        for name, buf in model.named_buffers():
            saved = next((s for s in spellings(model, name) if s in where), None)
            if saved is not None:
                _check_buffer(path, name, shapes[saved], buf)
                value = where[saved].get_tensor(saved)
                stats.bytes_read += value.numel() * value.element_size()
                buf.copy_(value)
                stats.tensors += 1
    return stats


def _fill_from_slice(param: torch.Tensor, shard: TPShard | None, sl, stats: LoadStats) -> None:
    """Note [reading only this rank's shard]: each piece of the shard is one slice read."""
    if shard is None:
        value = sl[:]
        stats.bytes_read += value.numel() * value.element_size()
        param.copy_(value)
        stats.tensors += 1
        return
    if shard.held < shard.local_size:
        param.zero_()  # vocabulary padding: in no file, kept at zero
    lead = (slice(None),) * shard.dim
    for local, logical, length in shard.pieces:
        value = sl[(*lead, slice(logical, logical + length))]
        stats.bytes_read += value.numel() * value.element_size()
        param.narrow(shard.dim, local, length).copy_(value)
    stats.tensors += 1


# -- meshspeed checkpoints --------------------------------------------------------------------
def _load_meshspeed(model: nn.Module, path: str) -> LoadStats:
    path = resolve(path, None)
    meta = read_meta(path)
    stats = LoadStats()
    store = _CountingStore(path, meta, stats)
    shapes = {n: tuple(info["shape"]) for n, info in meta["params"].items()}
    found = _check_fit(path, model, shapes, meta.get("aliases", {}))
    params = dict(model.named_parameters())
    shards = shards_by_param(model)
    with torch.no_grad():
        for name, saved in found.items():
            p = params[name]
            shard = shards.get(id(p))
            # The masters are fp32; read_into converts into the parameter's dtype/device.
            target = p if p.is_contiguous() else torch.empty_like(p)
            _fill_exact(store, store.plan(saved, 0, p.numel(), shard), target.view(-1))
            if target is not p:
                p.copy_(target)
            stats.tensors += 1
        buffers = dict(model.named_buffers())
        rank0 = next((r["file"] for r in meta.get("ranks", []) if r["rank"] == 0), None)
        for name, info in meta.get("buffers", {}).items():
            if name not in buffers:
                stats.skipped_buffers.append(name)
                continue
            _check_buffer(path, name, tuple(info["shape"]), buffers[name])
            value = store.read(info.get("file", rank0), f"buffer/{name}")
            buffers[name].copy_(value)
            stats.tensors += 1
    return stats


def _fill_exact(store: SavedTensors, plan, flat: torch.Tensor) -> None:
    """SavedTensors.fill_planned reading only the elements wanted: the training loader
    merges reads across gaps (fewer, larger reads of a row-split tensor, i.e. all of it);
    here only touching pieces are merged (Note [reading only this rank's shard])."""
    store.fill_planned(plan, "master", flat, gap=0)


class _CountingFile(TensorFile):
    """A tensor file that adds every read's bytes to a LoadStats."""

    def __init__(self, path: str, stats: LoadStats):
        super().__init__(path)
        self.stats = stats

    def read_into(self, name: str, start: int, end: int, out: torch.Tensor) -> None:
        self.stats.bytes_read += (end - start) * self.entry(name).dtype.itemsize
        super().read_into(name, start, end, out)


class _CountingStore(SavedTensors):
    def __init__(self, path: str, meta: dict, stats: LoadStats):
        super().__init__(path, meta)
        self.stats = stats

    def file(self, name: str) -> TensorFile:
        if name not in self._files:
            self._files[name] = _CountingFile(os.path.join(self.path, name), self.stats)
        return self._files[name]


__all__ = ["LoadStats", "load_into_shards"]
